"""The World's RPC backend is the one way RpcGroup and RemoteRef reach another member; how a World picks it.

One 2-process world per backend (TensorPipe and c10d, whatever ``PC_RPC_BACKEND`` says); each rank wraps its
World's backend in a recorder that delegates to it, then rank 0 calls rank 1 every way a group can (plain
calls, services, paired values). Every send must show up in the recorder, addressed to the member by name, and
``World.stop`` must shut the backend down through it: a call that went to torch's RPC directly, or a stop that
skipped the backend, fails these tests.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any

import pytest
import torch
from distributed_testutils import fork_unless_cuda

import pc_distributed as pd
from pc_distributed import _torch_dist
from pc_distributed.rpc._backends import AUTO_CHOICE, ENV_VAR, choose_backend
from pc_distributed.rpc._c10d import C10dBackend
from pc_distributed.rpc._tensorpipe import TensorPipeBackend

_CLASSES = {"tensorpipe": TensorPipeBackend.__name__, "c10d": C10dBackend.__name__}


class _Recorder:
    """An RpcBackend that records each send and shutdown, then hands it to the backend it wraps."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sends: list[tuple[str, str]] = []
        self.shutdowns: list[tuple[bool, float]] = []

    @property
    def name(self) -> str:
        return str(self.inner.name)

    def plain_pickles(self, value: Any) -> bool:
        return bool(self.inner.plain_pickles(value))

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
        "backend": (type(world.rpc_agent).__name__, getattr(world.rpc_agent, "name", None)),
    }
    recorder = _Recorder(world.rpc_agent)
    world.rpc_agent = recorder
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


@pytest.fixture(scope="module", params=["tensorpipe", "c10d"])
def observed(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    out = pd.run_world(
        _checks, 2, timeout=120, start_method=fork_unless_cuda(), rpc_timeout=30, rpc_backend=request.param
    )
    for o in out:
        o["asked"] = request.param
    return out


def test_the_world_starts_the_backend_it_was_asked_for(observed: list[dict[str, Any]]) -> None:
    asked = observed[0]["asked"]
    assert [o["backend"] for o in observed] == [(_CLASSES[asked], asked)] * 2


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


# -- a service that stops its own World --------------------------------------------------------------------

_STOPPED = threading.Event()
_SEEN: dict[str, Any] = {}


def _stop_my_world() -> str:
    world = pd.get_world()
    assert world is not None
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            world.stop(timeout=5, graceful=False)
        except BaseException as exc:  # recorded for the test: it must not happen
            _SEEN["error"] = repr(exc)
    _SEEN["after"] = time.monotonic() - started
    _SEEN["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    _SEEN["cleared"] = pd.get_world() is None
    _STOPPED.set()
    return "stopped"


def _stopped_from_inside(rank: int) -> dict[str, Any]:
    world = pd.get_world()
    assert world is not None
    group = world.create_rpc_group("selfstop", ["0", "1"])
    if rank == 1:
        group.register("stop", _stop_my_world)
    group.barrier(timeout=30)
    if rank == 0:
        try:
            return {"caller": repr(group.registered_sync("stop", timeout=60))}
        except ConnectionError as exc:  # any other error fails the rank, and the test with it
            return {"caller": f"ConnectionError: {exc}"}
    return {"done": _STOPPED.wait(60), **_SEEN}


@pytest.mark.parametrize("backend", ["tensorpipe", "c10d"])
def test_a_service_that_stops_its_own_world_ends_in_time(backend: str) -> None:
    caller, stopped = pd.run_world(
        _stopped_from_inside,
        2,
        timeout=120,
        start_method=fork_unless_cuda(),
        rpc_timeout=30,
        rpc_backend=backend,
    )
    assert stopped["done"]
    assert "error" not in stopped
    assert stopped["cleared"]
    assert stopped["after"] < 20  # bounded by the stop's timeout (5 s); it never returned on TensorPipe
    # the caller is told the member is gone (its reply never came: the member stopped first)
    assert caller["caller"].startswith("ConnectionError")
    assert "'1'" in caller["caller"]
    if backend == "tensorpipe":  # torch's shutdown waits for this very handler: left to end in the background
        assert any("goes on in the background" in w for w in stopped["warnings"])
    else:
        assert stopped["warnings"] == []


# -- choosing a backend --------------------------------------------------------------------------------------


def test_auto_reads_the_environment_variable_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "c10d")
    assert choose_backend("auto") == "c10d"
    monkeypatch.setenv(ENV_VAR, "TensorPipe")
    assert choose_backend("auto") == "tensorpipe"
    assert choose_backend("c10d") == "c10d"  # an explicit choice wins over the variable
    monkeypatch.setenv(ENV_VAR, "mpi")
    with pytest.raises(ValueError, match=ENV_VAR):
        choose_backend("auto")


def test_auto_without_the_variable_follows_what_torch_has(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert choose_backend("auto") == (AUTO_CHOICE if _torch_dist.rpc_available() else "c10d")
    # a torch build without torch.distributed.rpc: auto falls back to c10d, tensorpipe is refused
    monkeypatch.setattr(_torch_dist, "rpc_available", lambda: False)
    assert choose_backend("auto") == "c10d"
    with pytest.raises(ValueError, match=r"no torch\.distributed\.rpc"):
        choose_backend("tensorpipe")


def test_a_bad_backend_is_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="'grpc'"):
        pd.World(name="x", rpc_backend="grpc")
    with pytest.raises(TypeError, match="rpc_backend"):
        pd.World(name="x", rpc_backend=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'grpc'"):
        pd.run_world(_add, 1, rpc_backend="grpc")
    assert pd.get_world() is None
