"""The torchrun example of docs/distributed.md, run with torchrun (``python -m torch.distributed.run``).

The script is taken from the page itself, so the guide and this test cannot drift apart. ``--standalone``
runs the rendezvous on loopback on a free port; World must then read RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT and join the store that torchrun's agent serves.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from integration_docs import ROOT, run_under_torchrun

GUIDE = ROOT / "docs" / "distributed.md"


@pytest.mark.timeout(300)
def test_torchrun_example_of_the_guide_runs_under_torchrun(tmp_path: Path) -> None:
    done = run_under_torchrun(GUIDE, "hello_torchrun.py", tmp_path)
    out, err = done.stdout, done.stderr
    assert done.returncode == 0, f"--- stdout\n{out}\n--- stderr\n{err}"
    # both ranks write to one pipe: unbuffered, a line and its newline may reach it apart (interleaved)
    assert sorted(re.findall(r"worker\d: sum [0-9.]+, neighbour worker\d", out)) == [
        "worker0: sum 3.0, neighbour worker1",
        "worker1: sum 3.0, neighbour worker0",
    ], out
    assert (
        not out.replace("\n", "")
        .replace("worker0: sum 3.0, neighbour worker1", "")
        .replace("worker1: sum 3.0, neighbour worker0", "")
    ), out  # nothing else on stdout
