"""The torchrun example of docs/distributed.md, run with torchrun (``python -m torch.distributed.run``).

The script is taken from the page itself, so the guide and this test cannot drift apart. ``--standalone``
runs the rendezvous on loopback on a free port; World must then read RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT and join the store that torchrun's agent serves.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from integration_docs import ROOT, parse_blocks
from integration_procs import run_group

GUIDE = ROOT / "docs" / "distributed.md"


def _torchrun_example() -> str:
    blocks = [
        b for b in parse_blocks(GUIDE) if b.lang == "python" and b.code.startswith("# hello_torchrun.py")
    ]
    assert len(blocks) == 1, (
        f"{GUIDE} should hold exactly one '# hello_torchrun.py' block, found {len(blocks)}"
    )
    return blocks[0].code


@pytest.mark.timeout(300)
def test_torchrun_example_of_the_guide_runs_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "hello_torchrun.py"
    script.write_text(_torchrun_example())
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        script.name,
    ]
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    done = run_group(command, cwd=tmp_path, env=env, timeout=240)
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
