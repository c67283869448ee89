"""Issue 14 part 4 over real RPC: checkpoint every reducer, SIGKILL the primary, rebuild the world, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_restart import AFTER, BEFORE, after_world, before_world, serial_weights

pc_distributed = pytest.importorskip("pc_distributed")

RPC_TIMEOUT = 5.0


def test_primary_killed_then_restarted_from_its_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(pc_distributed.RankDiedError):
        pc_distributed.run_world(
            before_world, 3, args=(str(tmp_path),), timeout=150, rpc_timeout=RPC_TIMEOUT, dist_timeout=30
        )
    seen = json.loads((tmp_path / "client.json").read_text())
    assert seen["accepted"] == [True] * BEFORE
    assert seen["ledger"] == {
        "total": {**dict.fromkeys(seen["ledger"]["total"], 0), "accepted": BEFORE, "applied": BEFORE},
        "balanced": True,
    }
    # clients of the dead primary get an error naming the server, not a hang
    for what, server in (("dead_pull", "'gs_o_server'"), ("dead_ledger", "'gs'")):
        kind, message = seen[what]
        assert kind in ("ConnectionError", "TimeoutError"), seen[what]
        assert server in message, seen[what]

    results = pc_distributed.run_world(
        after_world, 3, args=(str(tmp_path),), timeout=150, rpc_timeout=RPC_TIMEOUT, dist_timeout=30
    )
    primary, client = results[0], results[2]
    assert primary["version_at_load"] == BEFORE
    assert client["start_version"] == BEFORE  # the first pull of the rebuilt world sees the checkpoint
    assert client["accepted"] == [True] * AFTER
    assert primary["version"] == BEFORE + AFTER
    assert primary["last_epoch"] == BEFORE + AFTER
    # momentum buffers and the lr schedule came back too: the weights are the serial result of every push
    assert primary["weights"] == pytest.approx(serial_weights(BEFORE + AFTER))
    assert primary["weights"] != pytest.approx(serial_weights(AFTER))
    total = client["ledger"]["total"]
    assert client["ledger"]["balanced"]
    assert (total["accepted"], total["applied"], total["duplicates"]) == (BEFORE + AFTER, BEFORE + AFTER, 0)
    assert client["mine_applied"] == AFTER
