"""A gradient server restarted by torchrun from its checkpoint (issue 14; recipe in docs/server.md).

``torchrun --standalone --nproc_per_node 3 --max-restarts 1`` runs integration_server_restart.py: the primary
reducer checkpoints, is SIGKILLed once enough pushes are applied, torchrun restarts the whole group, every
reducer loads its checkpoint and the client continues. ``--standalone`` picks a free rendezvous port; the
job runs in its own session and is killed as a group whatever happens.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from integration_procs import run_group
from integration_server_restart import AFTER, BEFORE, serial_weights

SCRIPT = Path(__file__).with_name("integration_server_restart.py")


@pytest.mark.timeout(180)
def test_torchrun_restarts_the_primary_from_its_checkpoint(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "3",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.2",
        str(SCRIPT),
        str(tmp_path),
    ]
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join(sys.path)  # the workers import this checkout's packages
    done = run_group(command, cwd=tmp_path, env=env, timeout=150)
    out, err = done.stdout, done.stderr
    assert done.returncode == 0, f"--- stdout\n{out}\n--- stderr\n{err}"
    assert f"rank 0: version {BEFORE + 2}, killing myself" in out, out  # the first attempt really died
    primary = json.loads((tmp_path / "primary.json").read_text())
    client = json.loads((tmp_path / "client.json").read_text())
    assert primary["restart"] == client["restart"] == 1  # written by the restarted attempt
    assert client["start_version"] == BEFORE  # the restarted primary published its checkpoint's version
    assert client["accepted"] == [True] * AFTER
    assert primary["version"] == primary["last_epoch"] == BEFORE + AFTER
    # model, momentum buffers and lr schedule came back: the serial result of every surviving push, once each
    assert primary["weights"] == pytest.approx(serial_weights(BEFORE + AFTER))
    assert primary["weights"] != pytest.approx(serial_weights(AFTER))
    ledger = client["ledger"]
    assert client["balanced"]
    assert (ledger["accepted"], ledger["applied"], ledger["duplicates"]) == (BEFORE + AFTER,) * 2 + (0,)
    assert sorted(client["clients"].values()) == [AFTER, BEFORE]  # the first client's and the restarted one's
