"""World lifecycle in one process: singleton, idempotent stop, a new World after stop, init_rpc/init_dist off.

Runs inside a forked one-rank world so that the pytest process never initialises torch.distributed itself.
"""

from __future__ import annotations

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
