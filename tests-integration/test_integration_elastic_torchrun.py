"""The torchrun example of docs/elastic.md, run with torchrun (``python -m torch.distributed.run``).

The script is taken from the page itself. ``--standalone`` makes torchrun's agent serve the store, which
``ElasticDataParallel`` must find through ``MASTER_ADDR``/``MASTER_PORT`` and
``TORCHELASTIC_USE_AGENT_STORE``; both members must train every step together.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from integration_docs import ROOT, parse_blocks
from integration_procs import run_group

GUIDE = ROOT / "docs" / "elastic.md"


def _torchrun_example() -> str:
    blocks = [
        b for b in parse_blocks(GUIDE) if b.lang == "python" and b.code.startswith("# train_elastic.py")
    ]
    assert len(blocks) == 1, (
        f"{GUIDE} should hold exactly one '# train_elastic.py' block, found {len(blocks)}"
    )
    return blocks[0].code


@pytest.mark.timeout(300)
def test_elastic_example_trains_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "train_elastic.py"
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
    assert sorted(re.findall(r"w\d-0: 5 steps, last with \['w0-0', 'w1-0'\]", out)) == [
        "w0-0: 5 steps, last with ['w0-0', 'w1-0']",
        "w1-0: 5 steps, last with ['w0-0', 'w1-0']",
    ], out
