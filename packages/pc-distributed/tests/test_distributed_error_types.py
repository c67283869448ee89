"""Errors follow the convention: ValueError/TypeError for bad input, ConnectionError naming who is gone.

A bad ``dist_backend`` and an unpicklable RPC argument are checked in a forked one-rank world. The lost store
is a real one: a store server process is SIGKILLed under a World that uses it, and that World's next barrier
and group creation must raise ``ConnectionError`` naming the store, with torch's error as ``__cause__``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch.distributed as dist
from distributed_testutils import fork_unless_cuda

import pc_distributed as pd

T = 60  # every wait of these tests ends within this many seconds


def _outcome(fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        cause = exc.__cause__
        return {
            "type": type(exc).__name__,
            "is": {k: isinstance(exc, v) for k, v in _KINDS.items()},
            "text": str(exc),
            "cause": None if cause is None else type(cause).__name__,
        }
    return {"type": "no error"}


_KINDS = {"ValueError": ValueError, "TypeError": TypeError, "ConnectionError": ConnectionError}


def _double(x: int) -> int:
    return 2 * x


def _bad_input(rank: int) -> dict[str, Any]:
    world = pd.get_world()
    assert world is not None
    group = world.create_rpc_group("g", ["0"])
    group.register("double", _double)
    local = 5
    sock = socket.socket()  # neither pickle nor pc-pickle carries a socket (a lambda travels by value)
    out = {
        "sock_arg": _outcome(group.rpc_sync, "0", _double, args=(sock,)),
        "sock_kwarg": _outcome(group.rpc_async, "0", _double, kwargs={"x": sock}),
        "sock_func": _outcome(group.remote, "0", sock.fileno),
        "service_arg": _outcome(group.registered_sync, "double", args=(sock,)),
        "still_works": group.rpc_sync("0", _double, args=(21,)),
        "lambda_works": group.rpc_sync("0", lambda: local * 2),
    }
    sock.close()
    group.destroy()
    world.stop()
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        os.environ.pop(key, None)  # the next Worlds are one-process worlds of their own
    out["backend"] = _outcome(pd.World, name="x", init_rpc=False, dist_timeout=10, dist_backend="nope")
    out["left_over"] = pd.get_world()
    mixed = pd.World(name="y", init_rpc=False, dist_timeout=10, dist_backend="cpu:GLOO")  # any case, pairs
    out["mixed"] = mixed.dist_backend
    mixed.stop()
    return out


@pytest.fixture(scope="module")
def bad_input() -> dict[str, Any]:
    (result,) = pd.run_world(
        _bad_input, 1, timeout=120, start_method=fork_unless_cuda(), init_dist=False, dist_timeout=20
    )
    return result  # type: ignore[no-any-return]


def test_unknown_backend_is_a_value_error_naming_it_and_the_allowed_ones(bad_input: dict[str, Any]) -> None:
    out = bad_input["backend"]
    assert out["type"] == "ValueError", out
    assert "'nope'" in out["text"]
    assert "gloo" in out["text"]
    assert bad_input["left_over"] is None
    assert bad_input["mixed"] == "cpu:GLOO"


@pytest.mark.parametrize(
    ("case", "names"),
    [
        ("sock_arg", "args[0]"),
        ("sock_kwarg", "kwargs['x']"),
        ("sock_func", "func"),
        ("service_arg", "args[0]"),
    ],
)
def test_unpicklable_rpc_argument_is_a_type_error_naming_it(
    bad_input: dict[str, Any], case: str, names: str
) -> None:
    out = bad_input[case]
    assert out["is"]["TypeError"], out
    assert names in out["text"], out
    assert "pc-pickle" in out["text"], out  # by value was tried too
    assert out["cause"] is not None, out
    assert bad_input["still_works"] == 42
    assert bad_input["lambda_works"] == 10


def _serve_store(conn: Connection) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    conn.send(store.port)
    conn.poll(3 * T)  # killed long before; the bound only keeps a stray server from living on


def _survivor(port: int, conn: Connection) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK="0",
        WORLD_SIZE="1",
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    world = pd.World(name="b", init_dist=False, init_rpc=False, dist_timeout=10)
    group = world.create_rpc_group("g", ["b"])
    group.barrier(timeout=10)
    conn.send("ready")
    if not conn.poll(T):
        return
    conn.recv()  # the store's server is dead now
    out = {
        "barrier": _outcome(group.barrier, timeout=10),
        "create_rpc_group": _outcome(world.create_rpc_group, "g2", ["b"]),
    }
    conn.send(out)
    with contextlib.suppress(Exception):  # stop with the store gone may report it; not under test here
        world.stop(timeout=3)


def test_lost_store_is_a_connection_error_naming_the_store() -> None:
    ctx = multiprocessing.get_context("fork")
    server_end, server_child = ctx.Pipe()
    server = ctx.Process(target=_serve_store, args=(server_child,), daemon=True)
    server.start()
    survivor = None
    try:
        assert server_end.poll(T)
        port = server_end.recv()
        end, child = ctx.Pipe()
        survivor = ctx.Process(target=_survivor, args=(port, child), daemon=True)
        survivor.start()
        assert end.poll(T)
        assert end.recv() == "ready"
        os.kill(server.pid, signal.SIGKILL)  # type: ignore[arg-type]
        server.join(T)
        end.send("go")
        assert end.poll(T)
        out = end.recv()
    finally:
        for proc in (server, survivor):
            if proc is not None and proc.is_alive():
                proc.kill()
            if proc is not None:
                proc.join(T)
    for call in ("barrier", "create_rpc_group"):
        got = out[call]
        assert got["is"]["ConnectionError"], got
        assert "the store of World 'b'" in got["text"], got
        assert f"127.0.0.1:{port}" in got["text"], got  # who served it
        assert got["cause"] is not None, got
