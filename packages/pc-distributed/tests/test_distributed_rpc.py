"""RpcGroup on a real 3-process world: calls, pair/register semantics, errors, barriers, timeouts, races.

One spawned world runs all checks (``_rpc_checks``) and returns its observations; each test asserts one
behaviour on them.
"""

from __future__ import annotations

import pickle
import threading
from typing import Any

import pytest
import torch
from distributed_testutils import fork_unless_cuda

import pc_distributed as pd


class WorkerService:
    """A service with state: calls must reach this live object on its owner."""

    def __init__(self, start: int) -> None:
        self.counter = start

    def count(self) -> int:
        self.counter += 1
        return self.counter


class UnpicklableError(Exception):
    def __init__(self) -> None:
        super().__init__("cannot travel")
        self.lock = threading.Lock()


def add(a: int, b: int) -> int:
    return a + b


def raise_value_error(x: int) -> None:
    raise ValueError(f"remote bad value {x}")


def raise_unpicklable() -> None:
    raise UnpicklableError()


def apply(f: Any, x: Any) -> Any:
    return f(x)


def make_adder(k: int) -> Any:
    return lambda v: v + k


def make_generator() -> Any:
    return (i for i in range(3))  # neither pickle nor pc-pickle carries a generator


def wait_a_while(seconds: float) -> str:
    threading.Event().wait(seconds)  # deliberately slow, to exceed a per-call timeout
    return "late"


def whoami() -> str:
    return pd.get_cur_name()


def _catch(fn: Any, *args: Any, **kwargs: Any) -> tuple[str, str, str | None]:
    try:
        result = fn(*args, **kwargs)
        if hasattr(result, "wait"):
            result.wait()
        elif hasattr(result, "to_here"):
            result.to_here()
    except Exception as exc:
        cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else None
        return type(exc).__name__, str(exc), cause
    return "no error", "", None


def _rpc_checks(rank: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    world = pd.get_world()
    assert world is not None
    me = str(rank)
    group = world.create_rpc_group("group", ["2", "1", "0"])
    out: dict[str, Any] = {
        "members": group.get_group_members(),
        "size": group.size(),
        "name": group.get_group_name(),
    }
    out["is_member"] = (group.is_member(), group.is_member("3"), group.get_cur_name())

    # plain calls
    out["calls"] = [
        group.rpc_sync("1", add, args=(1, 2)),
        group.rpc_async("2", add, args=(1, 2)).wait(),
        group.remote("0", add, args=(1, 2)).to_here(),
        group.rpc_sync("2", add, kwargs={"a": 1, "b": 2}),
    ]
    # what plain pickle refuses (a closure as the function, lambdas as arguments) travels by value
    offset = 100 + rank
    peer = str((rank + 1) % 3)
    if rank == 0:
        group.register("apply", apply)
        group.register("make_adder", make_adder)
        group.pair("adder", make_adder(10))
    group.barrier()
    out["by_value"] = [
        group.rpc_sync(peer, lambda v: v + offset, args=(1,)),
        group.rpc_async(peer, apply, args=(lambda v: v * 2, 21)).wait(),
        group.remote(peer, apply, kwargs={"f": lambda v: v - offset, "x": offset}).to_here(),
        group.registered_sync("apply", args=(lambda v: [v, offset], 7)),  # on rank 0: no RPC, same copy
        group.registered_remote("apply", args=(lambda v: v + 1, 1)).to_here(),
    ]
    # results that plain pickle refuses come back by value too
    out["results_by_value"] = [
        group.rpc_sync(peer, make_adder, args=(5,))(1),
        group.rpc_async(peer, make_adder, args=(4,)).wait()(1),
        group.remote(peer, make_adder, args=(2,)).to_here()(1),
        group.registered_sync("make_adder", args=(3,))(1),  # on rank 0: no RPC, same copy
        group.registered_async("make_adder", args=(6,)).wait()(1),
        group.get_paired("adder").to_here()(1),
    ]
    # a large tensor both ways through a future (on rank 0 an RPC to itself) and a blocking call
    block = torch.ones(1 << 15)  # 128 kB
    out["large_tensors"] = [
        float(group.registered_async("apply", args=(lambda v: v * 2, block)).wait().sum()),
        float(group.registered_sync("apply", args=(lambda v: v * 3, block)).sum()),
        float(group.rpc_sync(peer, apply, args=(lambda v: v + 1, block)).sum()),
        float(block.sum()),
    ]
    out["unpicklable_result"] = _catch(group.rpc_sync, peer, make_generator)
    out["unpicklable_service_result"] = _catch(
        group.registered_sync, "apply", args=(lambda _: make_generator(), 0)
    )
    out["ref_as_argument"] = _catch(group.rpc_sync, peer, repr, args=(group.remote(peer, add, args=(1, 2)),))
    out["not_member_target"] = _catch(group.rpc_sync, "9", add, args=(1, 2))
    out["bad_args"] = _catch(group.rpc_sync, "1", add, args=5)
    out["bad_timeout"] = _catch(group.rpc_sync, "1", add, timeout=0, args=(1, 2))

    # pair and register: rank 0 owns, the others see KeyErrors with the seed's messages
    service = WorkerService(20)
    if rank == 0:
        group.pair("service", service)
        group.register("count", service.count)
        group.register("boom", raise_value_error)
        out["dup_pair_own"] = _catch(group.pair, "service", service)
    group.barrier()
    out["is_paired"] = (group.is_paired("service"), group.is_paired("nothing"))
    out["is_registered"] = (group.is_registered("count"), group.is_registered("nothing"))
    if rank != 0:
        out["dup_pair"] = _catch(group.pair, "service", service)
        out["dup_register"] = _catch(group.register, "count", service.count)
        out["foreign_unpair"] = _catch(group.unpair, "service")
        out["foreign_deregister"] = _catch(group.deregister, "count")
    out["missing_service"] = _catch(group.registered_sync, "nothing")
    out["missing_value"] = _catch(group.get_paired, "nothing")
    copy_ = group.get_paired("service").to_here()
    copy_.counter = 1000  # a copy: the owner's counter is untouched
    group.barrier()
    out["counter"] = group.registered_sync("count")  # 21, 22, 23 in some order
    group.barrier()
    if rank == 0:
        out["final_counter"] = service.counter
    group.barrier()  # no peer counts again before rank 0 has read the counter
    out["async_and_remote"] = (
        group.registered_async("count").wait() > 23,
        group.registered_remote("count").to_here() > 23,
    )

    # remote exceptions keep their type through every call kind
    out["errors"] = [
        _catch(group.registered_sync, "boom", args=(1,)),
        _catch(group.registered_async, "boom", args=(2,)),
        _catch(group.registered_remote, "boom", args=(3,)),
        _catch(group.rpc_sync, "1", raise_value_error, args=(4,)),
        _catch(group.rpc_async, "2", raise_value_error, args=(5,)),
        _catch(group.remote, "0", raise_value_error, args=(6,)),
    ]
    out["unpicklable"] = _catch(group.rpc_sync, "1", raise_unpicklable)
    out["timeout"] = _catch(group.rpc_sync, "2", wait_a_while, timeout=0.5, args=(5.0,))

    # stale cache: "moving" is registered on 1, cached everywhere, then moves to 2
    if rank == 1:
        group.register("moving", whoami)
    group.barrier()
    out["moving_before"] = group.registered_sync("moving")
    group.barrier()
    if rank == 1:
        group.deregister("moving")
    group.barrier()
    if rank == 2:
        group.register("moving", whoami)
    group.barrier()
    out["moving_after"] = (group.registered_sync("moving"), group.registered_async("moving").wait())
    group.barrier()

    # concurrent pair: exactly one winner across processes and threads
    wins: list[bool] = []

    def try_pair() -> None:
        try:
            group.pair("race", me)
            wins.append(True)
        except KeyError:
            wins.append(False)

    threads = [threading.Thread(target=try_pair) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    out["race_wins"] = sum(wins)
    group.barrier()
    out["race_owner"] = group.get_paired("race").to_here()

    # a handle travels by pickle and resolves to the live group here
    out["pickle_live"] = pickle.loads(pickle.dumps(group)) is group

    # 20 barriers in a row, then a barrier a member skips: the missing member is named
    for _ in range(20):
        group.barrier(timeout=30)
    lonely = world.create_rpc_group("lonely", ["0", "1", "2"])
    if rank != 2:
        out["barrier_missing"] = _catch(lonely.barrier, timeout=1)
    out["join_missing"] = (
        _catch(world.create_rpc_group, "partial", ["0", "1", "2"], timeout=1) if rank == 0 else None
    )
    group.barrier()
    lonely.destroy()

    # unpair/deregister by the owner; then the key is free again
    if rank == 0:
        group.unpair("service")
        group.deregister("count")
        out["unpaired"] = (group.is_paired("service"), group.is_registered("count"))
        out["stale_after_deregister"] = _catch(group.registered_sync, "count")
    group.barrier()
    group.destroy()
    out["destroyed"] = _catch(group.rpc_sync, "1", add, args=(1, 2))
    out["world_pickle"] = _catch(pickle.dumps, world)
    return out


@pytest.fixture(scope="module")
def observed() -> list[dict[str, Any]]:
    return pd.run_world(
        _rpc_checks, 3, timeout=170, dist_timeout=30, rpc_timeout=30, start_method=fork_unless_cuda()
    )


def test_group_info(observed: list[dict[str, Any]]) -> None:
    for rank, o in enumerate(observed):
        assert o["members"] == ["0", "1", "2"]
        assert o["size"] == 3
        assert o["name"] == "group"
        assert o["is_member"] == (True, False, str(rank))


def test_rpc_calls(observed: list[dict[str, Any]]) -> None:
    for o in observed:
        assert o["calls"] == [3, 3, 3, 3]
        assert o["not_member_target"][0] == "ValueError"
        assert o["bad_args"][0] == "TypeError"
        assert o["bad_timeout"][0] == "ValueError"


def test_lambdas_and_closures_travel_by_value(observed: list[dict[str, Any]]) -> None:
    for rank, o in enumerate(observed):
        assert o["by_value"] == [101 + rank, 42, 0, [7, 100 + rank], 2]


def test_results_that_plain_pickle_refuses_come_back_by_value(observed: list[dict[str, Any]]) -> None:
    for o in observed:
        assert o["results_by_value"] == [6, 5, 3, 4, 7, 11]


def test_large_tensors_cross_as_they_are_sent_on_every_path(observed: list[dict[str, Any]]) -> None:
    n = float(1 << 15)
    for o in observed:
        assert o["large_tensors"] == [2 * n, 3 * n, 2 * n, n]


def test_a_result_neither_pickler_carries_is_a_type_error_naming_it(observed: list[dict[str, Any]]) -> None:
    for o in observed:
        for case in ("unpicklable_result", "unpicklable_service_result"):
            kind, text, _ = o[case]
            assert kind == "TypeError", (case, o[case])
            assert "generator" in text, (case, o[case])


def test_a_remote_ref_sent_to_another_member_is_a_type_error_saying_what_to_do(
    observed: list[dict[str, Any]],
) -> None:
    for o in observed:
        kind, text, _ = o["ref_as_argument"]
        assert kind == "TypeError", o["ref_as_argument"]
        assert "a RemoteRef" in text, text
        assert "to_here()" in text, text


def test_pair_register_semantics_and_messages(observed: list[dict[str, Any]]) -> None:
    assert observed[0]["dup_pair_own"][0] == "KeyError"
    for o in observed:
        assert o["is_paired"] == (True, False)
        assert o["is_registered"] == (True, False)
        assert o["missing_service"][0] == "KeyError"
        assert "not found on Group [group]" in o["missing_service"][1]
        assert o["missing_value"][0] == "KeyError"
    for o in observed[1:]:
        assert o["dup_pair"][0] == "KeyError"
        assert "already paired to Group" in o["dup_pair"][1]
        assert "already registered in Group" in o["dup_register"][1]
        assert "not paired to Group [group] on Process" in o["foreign_unpair"][1]
        assert "not registered in Group [group] on Process" in o["foreign_deregister"][1]


def test_services_run_on_the_owners_live_object(observed: list[dict[str, Any]]) -> None:
    assert sorted(o["counter"] for o in observed) == [21, 22, 23]
    assert observed[0]["final_counter"] == 23  # copies from get_paired did not touch it
    for o in observed:
        assert o["async_and_remote"] == (True, True)


def test_remote_exceptions_keep_their_type(observed: list[dict[str, Any]]) -> None:
    for o in observed:
        for kind, msg, cause in o["errors"]:
            assert kind == "ValueError"
            assert "remote bad value" in msg
            assert cause == "RemoteTraceback"
        assert o["unpicklable"][0] == "RuntimeError"
        assert "UnpicklableError" in o["unpicklable"][1]


def test_per_call_timeout(observed: list[dict[str, Any]]) -> None:
    for o in observed:
        assert o["timeout"][0] == "TimeoutError"
        assert "'2'" in o["timeout"][1]


def test_stale_cache_is_refreshed(observed: list[dict[str, Any]]) -> None:
    for o in observed:
        assert o["moving_before"] == "1"
        assert o["moving_after"] == ("2", "2")


def test_concurrent_pair_has_one_winner(observed: list[dict[str, Any]]) -> None:
    assert sum(o["race_wins"] for o in observed) == 1
    owners = {o["race_owner"] for o in observed}
    assert len(owners) == 1
    (owner,) = owners
    assert observed[int(owner)]["race_wins"] == 1


def test_barriers_and_missing_members(observed: list[dict[str, Any]]) -> None:
    for o in observed[:2]:
        kind, msg, _ = o["barrier_missing"]
        assert kind == "TimeoutError"
        assert "['2']" in msg
    kind, msg, _ = observed[0]["join_missing"]
    assert kind == "TimeoutError"
    assert "['1', '2']" in msg


def test_unpair_deregister_destroy_pickle(observed: list[dict[str, Any]]) -> None:
    o = observed[0]
    assert o["unpaired"] == (False, False)
    assert o["stale_after_deregister"][0] == "KeyError"
    for o in observed:
        assert o["pickle_live"] is True
        assert o["destroyed"][0] == "RuntimeError"
        assert o["world_pickle"][0] == "TypeError"
