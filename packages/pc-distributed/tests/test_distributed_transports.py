"""TensorPipe's transports: by default no thread busy-polls; ``rpc_busy_poll=True`` restores torch's default.

TensorPipe's shared-memory transport runs a reactor thread (named ``TP_SHM_reactor``) that spins with
``sched_yield`` for the agent's whole life. The thread's presence is the observable: it is there only when
the World was created with ``rpc_busy_poll=True``. Runs inside a spawned one-rank world so that the pytest
process never initialises torch.distributed itself (spawned, not forked: a child forked from the many-threaded
pytest process once hung past the 120 s bound in the full suite, while it passes in 2 s alone).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

import pc_distributed as pd

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="thread names are read from /proc")

_SHM_REACTOR = "TP_SHM_reactor"


def _thread_names() -> list[str]:
    return sorted(p.read_text().strip() for p in Path(f"/proc/{os.getpid()}/task").glob("*/comm"))


def _triple(x: int) -> int:
    return 3 * x


def _transports(rank: int) -> dict[str, Any]:
    world = pd.get_world()
    assert world is not None
    world.stop()
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        os.environ.pop(key, None)
    out: dict[str, Any] = {}
    for label, kwargs in (("default", {}), ("busy_poll", {"rpc_busy_poll": True})):
        solo = pd.World(
            name=f"tp_{label}", dist_timeout=15, rpc_timeout=15, rpc_backend="tensorpipe", **kwargs
        )
        group = solo.create_rpc_group("g", [solo.name])
        group.register("triple", _triple)
        out[label] = {
            "attribute": solo.rpc_busy_poll,
            "reactors": _thread_names().count(_SHM_REACTOR),
            "call": group.registered_sync("triple", args=(14,)),
            "plain_call": group.rpc_sync(solo.name, _triple, args=(5,)),
        }
        solo.stop(timeout=10)
    return out


def test_no_busy_polling_thread_by_default_and_one_on_request() -> None:
    (out,) = pd.run_world(_transports, 1, timeout=120)
    assert out["default"] == {"attribute": False, "reactors": 0, "call": 42, "plain_call": 15}
    assert out["busy_poll"] == {"attribute": True, "reactors": 1, "call": 42, "plain_call": 15}
