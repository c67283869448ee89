"""The torchrun example of docs/elastic.md, run with torchrun (``python -m torch.distributed.run``).

The script is taken from the page itself. ``--standalone`` makes torchrun's agent serve the store, which
``ElasticDataParallel`` must find through ``MASTER_ADDR``/``MASTER_PORT`` and
``TORCHELASTIC_USE_AGENT_STORE``; both members must train every step together.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from integration_docs import ROOT, run_under_torchrun

GUIDE = ROOT / "docs" / "elastic.md"


@pytest.mark.timeout(300)
def test_elastic_example_trains_under_torchrun(tmp_path: Path) -> None:
    done = run_under_torchrun(GUIDE, "train_elastic.py", tmp_path)
    out, err = done.stdout, done.stderr
    assert done.returncode == 0, f"--- stdout\n{out}\n--- stderr\n{err}"
    assert sorted(re.findall(r"w\d-0: 5 steps, last with \['w0-0', 'w1-0'\]", out)) == [
        "w0-0: 5 steps, last with ['w0-0', 'w1-0']",
        "w1-0: 5 steps, last with ['w0-0', 'w1-0']",
    ], out
