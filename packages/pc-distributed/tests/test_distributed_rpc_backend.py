"""The World's RPC backend is the one way RpcGroup and RemoteRef reach another member.

One 2-process world; each rank wraps its World's backend in a recorder that delegates to it, then rank 0 calls
rank 1 every way a group can (plain calls, services, paired values). Every send must show up in the recorder,
addressed to the member by name, and ``World.stop`` must shut the backend down through it: a call that went to
torch's RPC directly, or a stop that skipped the backend, fails these tests.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed_testutils import fork_unless_cuda

import pc_distributed as pd
from pc_distributed.rpc._tensorpipe import TensorPipeBackend


class _Recorder:
    """An RpcBackend that records each send and shutdown, then hands it to the backend it wraps."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sends: list[tuple[str, str]] = []
        self.shutdowns: list[tuple[bool, float]] = []

    @property
    def name(self) -> str:
        return str(self.inner.name)

    def call_sync(self, to: str, fn: Any, args: Any, kwargs: Any, timeout: float) -> Any:
        self.sends.append(("call_sync", to))
        return self.inner.call_sync(to, fn, args, kwargs, timeout)

    def call(self, to: str, fn: Any, args: Any, kwargs: Any, timeout: float) -> Any:
        self.sends.append(("call", to))
        return self.inner.call(to, fn, args, kwargs, timeout)

    def remote(self, to: str, fn: Any, args: Any, kwargs: Any, timeout: float) -> Any:
        self.sends.append(("remote", to))
        return self.inner.remote(to, fn, args, kwargs, timeout)

    def shutdown(self, graceful: bool, timeout: float) -> None:
        self.shutdowns.append((graceful, timeout))
        self.inner.shutdown(graceful, timeout)


def _add(a: int, b: int = 0) -> int:
    return a + b


def _fail() -> None:
    raise ValueError("remote failure")


def _checks(rank: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    world = pd.get_world()
    assert world is not None
    out: dict[str, Any] = {
        "backend": (type(world.rpc_transport).__name__, getattr(world.rpc_transport, "name", None)),
    }
    recorder = _Recorder(world.rpc_transport)
    world.rpc_transport = recorder
    group = world.create_rpc_group("seam", ["0", "1"])
    if rank == 1:
        group.register("add", _add)
        group.pair("value", 7)
    group.barrier(timeout=30)
    if rank == 0:
        recorder.sends.clear()  # the barrier and directory go through the store, not the backend
        out["results"] = [
            group.rpc_sync("1", _add, args=(1, 2)),
            group.rpc_async("1", _add, args=(2,), kwargs={"b": 3}).wait(),
            group.remote("1", _add, args=(3, 4)).to_here(),
            group.registered_sync("add", args=(4, 5)),
            group.registered_async("add", args=(5, 6)).wait(),
            group.registered_remote("add", args=(6, 7)).to_here(),
            group.get_paired("value").to_here(),
        ]
        try:
            group.rpc_sync("1", _fail)
        except ValueError as exc:
            out["error"] = (str(exc), type(exc.__cause__).__name__, "_fail" in str(exc.__cause__))
        out["sends"] = list(recorder.sends)
    group.barrier(timeout=30)
    group.destroy()
    world.stop(timeout=30)
    out["shutdowns"] = recorder.shutdowns
    return out


@pytest.fixture(scope="module")
def observed() -> list[dict[str, Any]]:
    return pd.run_world(_checks, 2, timeout=120, start_method=fork_unless_cuda(), rpc_timeout=30)


def test_the_world_starts_the_tensorpipe_backend(observed: list[dict[str, Any]]) -> None:
    assert [o["backend"] for o in observed] == [(TensorPipeBackend.__name__, "tensorpipe")] * 2


def test_every_call_of_a_group_goes_through_the_backend(observed: list[dict[str, Any]]) -> None:
    assert observed[0]["results"] == [3, 5, 7, 9, 11, 13, 7]
    assert observed[0]["sends"] == [
        ("call_sync", "1"),
        ("call", "1"),
        ("remote", "1"),
        ("call_sync", "1"),
        ("call", "1"),
        ("remote", "1"),
        ("remote", "1"),
        ("call_sync", "1"),
    ]


def test_a_remote_exception_crosses_the_backend_with_its_traceback(observed: list[dict[str, Any]]) -> None:
    message, cause, names_the_function = observed[0]["error"]
    assert "remote failure" in message
    assert cause == "RemoteTraceback"
    assert names_the_function, "the remote traceback should show the frame that raised"


def test_world_stop_shuts_the_backend_down_gracefully(observed: list[dict[str, Any]]) -> None:
    assert [o["shutdowns"] for o in observed] == [[(True, 30.0)]] * 2
