"""RpcGroup calls that need no RPC or no directory: a service of this process, a call addressed to its owner.

One 2-process world runs the checks; rank 0 owns the services. A call to a service this process owns runs in
the caller's thread (nothing is sent through the RPC backend) on copies of the arguments and the result, as an
RPC would deliver them; a call given its ``owner`` never asks the group's directory.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed_testutils import fork_unless_cuda

import pc_distributed as pd
from pc_distributed.rpc._directory import Directory


class Keeper:
    """Keeps the last tensor it was given, and hands out the one it holds."""

    def __init__(self) -> None:
        self.kept = torch.zeros(2)
        self.held = torch.ones(2)

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        self.kept = t
        return self.held


def _fail(x: int) -> None:
    raise ValueError(f"bad {x}")


class _RpcCounter:
    """Counts the calls this process sends through its World's RPC backend (any backend) while active."""

    _SENDS = ("call_sync", "call", "remote")

    def __init__(self) -> None:
        self.count = 0
        world = pd.get_world()
        assert world is not None
        assert world.rpc_agent is not None
        self._backend = world.rpc_agent
        self._orig = {n: getattr(self._backend, n) for n in self._SENDS}

    def __enter__(self) -> _RpcCounter:
        for name, fn in self._orig.items():

            def wrapper(*a: Any, _fn: Any = fn, **kw: Any) -> Any:
                self.count += 1
                return _fn(*a, **kw)

            setattr(self._backend, name, wrapper)
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self._orig:
            delattr(self._backend, name)  # the instance attribute goes, the class's method answers again


def _catch(fn: Any, *args: Any, **kwargs: Any) -> tuple[str, str, str | None]:
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:
        cause = exc.__cause__
        return (type(exc).__name__, str(exc), None if cause is None else type(cause).__name__)
    return ("no error", repr(result), None)


def _checks(rank: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    world = pd.get_world()
    assert world is not None
    group = world.create_rpc_group("loc", ["0", "1"])
    out: dict[str, Any] = {}
    keeper = Keeper()
    if rank == 0:
        group.register("keep", keeper.keep)
        group.register("fail", _fail)
        out["tables_live"] = world.rpc_tables.get("loc") is not None
    group.barrier()
    if rank == 0:
        mine = torch.full((2,), 5.0)
        with _RpcCounter() as counter:
            got = group.registered_sync("keep", args=(mine,))
            failed = _catch(group.registered_sync, "fail", args=(3,))
        mine.add_(100)  # the caller's tensor after the call: the service kept a copy
        got.add_(100)  # and the result is a copy of what the service holds
        out["local"] = {
            "rpcs": counter.count,
            "kept": keeper.kept.tolist(),
            "held": keeper.held.tolist(),
            "failed": failed,
        }
        with _RpcCounter() as counter:
            out["local_async"] = (group.registered_async("keep", args=(torch.ones(2),)).wait().tolist(),)
        out["local_async_rpcs"] = counter.count
    group.barrier()  # rank 1's calls come after rank 0's
    if rank == 1:
        original = Directory.owner

        def no_directory(self: Directory, kind: str, ktext: str, refresh: bool) -> str | None:
            raise AssertionError("the directory was asked")

        Directory.owner = no_directory  # type: ignore[method-assign]
        try:
            out["by_owner"] = group.registered_sync("keep", args=(torch.full((2,), 7.0),), owner="0").tolist()
            out["by_owner_async"] = (
                group.registered_async("keep", args=(torch.full((2,), 8.0),), owner="0").wait().tolist()
            )
            out["by_owner_remote"] = (
                group.registered_remote("keep", args=(torch.full((2,), 9.0),), owner="0").to_here().tolist()
            )
            out["wrong_owner"] = _catch(group.registered_sync, "keep", args=(torch.ones(2),), owner="1")
            out["not_member"] = _catch(group.registered_sync, "keep", owner="9")
            out["owner_type"] = _catch(group.registered_sync, "keep", owner=0)
            out["through_directory"] = _catch(group.registered_sync, "keep", args=(torch.ones(2),))
        finally:
            Directory.owner = original  # type: ignore[method-assign]
    group.barrier()
    if rank == 0:
        out["kept_from_1"] = keeper.kept.tolist()
    group.destroy()
    out["tables_after_destroy"] = world.rpc_tables.get("loc")
    return out


@pytest.fixture(scope="module")
def observed() -> list[dict[str, Any]]:
    return pd.run_world(
        _checks, 2, timeout=150, dist_timeout=30, rpc_timeout=30, start_method=fork_unless_cuda()
    )


def test_a_service_of_this_process_runs_without_an_rpc_on_copies(observed: list[dict[str, Any]]) -> None:
    local = observed[0]["local"]
    assert local["rpcs"] == 0
    assert local["kept"] == [5.0, 5.0]  # not the caller's tensor, which changed after the call
    assert local["held"] == [1.0, 1.0]  # not the result, which the caller changed
    assert local["failed"] == ("ValueError", "bad 3", "RemoteTraceback")


def test_registered_async_to_this_process_is_still_one_rpc(observed: list[dict[str, Any]]) -> None:
    assert observed[0]["local_async"] == ([1.0, 1.0],)
    assert observed[0]["local_async_rpcs"] == 1


def test_a_call_given_its_owner_skips_the_directory(observed: list[dict[str, Any]]) -> None:
    o = observed[1]
    assert o["by_owner"] == [1.0, 1.0]
    assert o["by_owner_async"] == [1.0, 1.0]
    assert o["by_owner_remote"] == [1.0, 1.0]
    assert observed[0]["kept_from_1"] == [9.0, 9.0]
    assert o["wrong_owner"][0] == "KeyError"
    assert "not found on Group [loc]" in o["wrong_owner"][1]
    assert "'1'" in o["wrong_owner"][1]
    assert o["not_member"][0] == "ValueError"
    assert o["owner_type"][0] == "TypeError"
    assert o["through_directory"][0] == "AssertionError"  # without an owner the directory is asked


def test_the_world_owns_its_groups_tables(observed: list[dict[str, Any]]) -> None:
    assert observed[0]["tables_live"] is True
    assert all(o["tables_after_destroy"] is None for o in observed)
