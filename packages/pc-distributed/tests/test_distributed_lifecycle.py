"""World lifecycle in one process: singleton, idempotent stop, a new World after stop, init_rpc/init_dist off.

Runs inside a forked one-rank world so that the pytest process never initialises torch.distributed itself.
"""

from __future__ import annotations

import operator
import os
from typing import Any

import psutil
import pytest
from distributed_testutils import fork_unless_cuda

import pc_distributed as pd


def _catch(fn: Any, *args: Any, **kwargs: Any) -> tuple[str, str]:
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


def _lifecycle(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    world = pd.get_world()
    assert world is not None
    world.stop()
    out["after_stop"] = (pd.get_world(), pd.is_world_initialized(), _catch(pd.get_cur_rank)[0])
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        os.environ.pop(key, None)
    solo = pd.World(name="solo", dist_timeout=15, rpc_timeout=15)  # one process, free loopback port
    out["solo"] = (solo.rank, solo.world_size, solo.get_members(), pd.get_cur_name())
    out["second"] = _catch(pd.World, name="again")
    out["listening_on"] = sorted(
        {c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN}
    )
    group = solo.create_rpc_group("g", ["solo"])
    group.register("double", _double)
    out["self_call"] = group.registered_sync("double", args=(21,))
    out["seed_default"] = group.registered_sync("double", args=(2,), timeout=-1)  # machin's "the default"
    out["registry"] = (solo.get_rpc_group("g") is group, dict(solo.groups) == {"g": group})
    out["registry_read_only"] = _catch(operator.setitem, solo.groups, "x", group)[0]
    out["same_name_twice"] = _catch(solo.create_rpc_group, "g", ["solo"])
    group.destroy()
    out["after_destroy"] = (solo.get_rpc_group("g"), _catch(group.registered_sync, "double", args=(1,)))
    group = solo.create_rpc_group("g", ["solo"])  # the name is free again (a new instance of it)
    group.barrier(timeout=5)
    cg = solo.create_collective_group([0])
    out["cg_size"] = cg.size()
    solo.stop(timeout=5)
    solo.stop(timeout=5)  # idempotent
    out["stopped_twice"] = pd.get_world() is None
    no_rpc = pd.World(name="norpc", init_rpc=False, dist_timeout=15)
    group = no_rpc.create_rpc_group("g2", ["norpc"])
    group.pair("k", 1)
    out["no_rpc"] = (group.is_paired("k"), _catch(group.rpc_sync, "norpc", _double, args=(1,)))
    no_rpc.stop()
    no_dist = pd.World(name="nodist", init_dist=False, init_rpc=False, dist_timeout=15)
    out["no_dist"] = _catch(no_dist.create_collective_group, [0])
    no_dist.stop()
    out["bad"] = [
        _catch(pd.World, name="has space"),
        _catch(pd.World, name=3),
        _catch(pd.World, name="x", rank=2, world_size=2, dist_init_method="tcp://127.0.0.1:1"),
        _catch(pd.World, name="x", world_size=2),
        _catch(pd.World, name="x", dist_timeout=0),
    ]
    out["left_over"] = pd.get_world()
    out["interfaces"] = _interfaces()
    return out


_IFNAMES = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


def _interfaces() -> dict[str, Any]:
    """What World sets for gloo and TensorPipe: loopback by default, ``interface`` when given; restored."""
    out: dict[str, Any] = {}
    for key in _IFNAMES:
        os.environ.pop(key, None)
    world = pd.World(name="lo_default", init_rpc=False, dist_timeout=15)
    out["default"] = [os.environ.get(k) for k in _IFNAMES]
    world.stop()
    out["default_after"] = [os.environ.get(k) for k in _IFNAMES]
    os.environ["GLOO_SOCKET_IFNAME"] = "users_choice"
    world = pd.World(name="lo_user", init_dist=False, init_rpc=False, dist_timeout=15)
    out["user"] = os.environ.get("GLOO_SOCKET_IFNAME")  # left alone (World was given no interface)
    world.stop()
    world = pd.World(name="lo_given", addr="127.0.0.1", interface="lo", dist_timeout=15, rpc_timeout=15)
    out["given"] = [os.environ.get(k) for k in _IFNAMES]
    group = world.create_rpc_group("ifg", ["lo_given"])
    out["given_call"] = group.rpc_sync("lo_given", _double, args=(4,))
    world.stop()
    out["given_after"] = [os.environ.get(k) for k in _IFNAMES]
    out["bad"] = [
        _catch(pd.World, name="x", interface="no_such_if0"),
        _catch(pd.World, name="x", interface=3),
        _catch(pd.World, name="x", addr="127.0.0.1", dist_init_method="tcp://127.0.0.1:1"),
    ]
    out["left_over"] = pd.get_world()
    return out


def _double(x: int) -> int:
    return 2 * x


@pytest.fixture(scope="module")
def observed() -> dict[str, Any]:
    (result,) = pd.run_world(
        _lifecycle,
        1,
        timeout=120,
        start_method=fork_unless_cuda(),
        init_dist=False,
        init_rpc=False,
        dist_timeout=20,
    )
    return result


def test_stop_clears_the_singleton(observed: dict[str, Any]) -> None:
    assert observed["after_stop"] == (None, False, "RuntimeError")
    assert observed["stopped_twice"] is True
    assert observed["left_over"] is None


def test_default_world_is_one_process_on_loopback(observed: dict[str, Any]) -> None:
    assert observed["solo"] == (0, 1, ["solo"], "solo")
    assert observed["self_call"] == 42
    assert observed["cg_size"] == 1


def test_world_listens_on_loopback_only(observed: dict[str, Any]) -> None:
    assert observed["listening_on"], "the World should have listening sockets (store, gloo, TensorPipe)"
    assert all(ip.startswith("127.") for ip in observed["listening_on"]), observed["listening_on"]


def test_second_world_raises(observed: dict[str, Any]) -> None:
    assert observed["second"] == ("RuntimeError", "World could only be initialized once!")


def test_init_rpc_and_init_dist_off(observed: dict[str, Any]) -> None:
    paired, call = observed["no_rpc"]
    assert paired is True
    assert call[0] == "RuntimeError"
    assert "init_rpc=True" in call[1]
    assert observed["no_dist"][0] == "RuntimeError"
    assert "init_dist=True" in observed["no_dist"][1]


def test_bad_world_arguments(observed: dict[str, Any]) -> None:
    kinds = [kind for kind, _ in observed["bad"]]
    assert kinds == ["ValueError", "TypeError", "ValueError", "ValueError", "ValueError"]
    assert "needs a rendezvous address" in observed["bad"][3][1]


def test_world_binds_gloo_and_tensorpipe_to_loopback_by_default(observed: dict[str, Any]) -> None:
    got = observed["interfaces"]
    assert got["default"] == ["lo", "lo"]
    assert got["default_after"] == [None, None]  # restored when the World stopped


def test_world_leaves_the_users_interface_variables_alone(observed: dict[str, Any]) -> None:
    assert observed["interfaces"]["user"] == "users_choice"


def test_world_takes_the_address_and_interface(observed: dict[str, Any]) -> None:
    got = observed["interfaces"]
    assert got["given"] == ["lo", "lo"]
    assert got["given_call"] == 8
    assert got["given_after"] == ["users_choice", None]


def test_bad_address_and_interface_arguments(observed: dict[str, Any]) -> None:
    bad = observed["interfaces"]["bad"]
    assert bad[0][0] == "ValueError"
    assert "no network interface named 'no_such_if0'" in bad[0][1]
    assert bad[1][0] == "TypeError"
    assert bad[2][0] == "ValueError"
    assert "not both" in bad[2][1]
    assert observed["interfaces"]["left_over"] is None


def test_world_holds_its_rpc_groups(observed: dict[str, Any]) -> None:
    assert observed["seed_default"] == 4
    assert observed["registry"] == (True, True)
    assert observed["registry_read_only"] == "TypeError"  # only the World's methods change it
    assert observed["same_name_twice"][0] == "RuntimeError"
    assert "already exists" in observed["same_name_twice"][1]
    gone, call = observed["after_destroy"]
    assert gone is None
    assert call == ("RuntimeError", "RpcGroup 'g' has been destroyed")


def _collect_garbage(rank: int) -> int:
    import gc

    return gc.collect()  # would run an inherited group's destructor here if the parent had not


def test_a_forked_rank_does_not_inherit_garbage_it_cannot_collect() -> None:
    """A gloo group in a reference cycle, not yet collected when run_world forks: its destructor waits for
    worker threads that only the parent has, so a rank that collected it would hang (run_world would time
    out). run_world collects the caller's garbage before forking."""
    import gc

    import torch
    import torch.distributed as dist

    gc.disable()  # the cycle below stays uncollected until run_world collects it
    try:
        group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
        group.allreduce([torch.ones(1)]).wait()  # its worker threads are up, waiting for work
        cycle: list[Any] = [group]
        cycle.append(cycle)
        del cycle, group
        results = pd.run_world(
            _collect_garbage, 1, timeout=30, start_method="fork", init_rpc=False, init_dist=False
        )
    finally:
        gc.enable()
    assert len(results) == 1
    assert isinstance(results[0], int)
