"""pc-server failure paths over real RPC: a dead client, a hung handler, a dead server (no timing asserts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_world_checks import failure_world

pc_distributed = pytest.importorskip("pc_distributed")

RPC_TIMEOUT = 4.0


def test_client_death_hung_handler_and_server_death(tmp_path: Path) -> None:
    with pytest.raises(pc_distributed.RankDiedError):
        pc_distributed.run_world(
            failure_world,
            3,
            args=(str(tmp_path),),
            timeout=150,
            rpc_timeout=RPC_TIMEOUT,
            dist_timeout=30,
            grace_period=90,
        )
    report = json.loads((tmp_path / "rank1.json").read_text())
    # a dead client does not disturb the others
    assert report["push_after_client_death"] is False
    assert report["adopted"] == 1
    assert report["push_again"] is True
    # a hung handler: a TimeoutError naming the server (the RPC timeout ends it; the handler never returns)
    kind, _elapsed, message = report["hung"]
    assert kind == "TimeoutError", report["hung"]
    assert "hang" in message
    # a dead server: a ConnectionError (or the RPC's TimeoutError) naming it; times: benchmarks/faults.py
    kind, _elapsed, message = report["server_dead"]
    assert kind in ("ConnectionError", "TimeoutError"), report["server_dead"]
    assert "'ms_o_server'" in message
