"""tools/gpu_check.sh on a machine without CUDA: every step runs, says "no CUDA", and the folder is complete.

On a GPU machine the script itself is the check (CONTRIBUTING, "GPU check"); here it must not break on the
way there: a missing device is reported per step, the exit code says so (3), nothing is left half-written.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
STEPS = (
    "env",
    "wheels",
    "gpu-tests",
    "gpu-tests-c10d",
    "bench-pc-distributed-rpc_backends",
    "bench-pc-pickle",
    "bench-pc-pool",
    "bench-pc-sync",
    "bench-pc-sync-processes",
    "gpu-report",
    "demo",
)


@pytest.mark.slow
def test_gpu_check_without_cuda_runs_every_step_and_exits_3(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check would really run")
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PC_REQUIRE_GPU")}
    env["PYTHON"] = sys.executable
    env["PC_GPU_WHEELS"] = str(tmp_path / "no-wheels")  # everything needed is importable here already
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=400, env=env, check=False
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    summary = (out / "summary.txt").read_text()
    assert "no CUDA: torch sees no CUDA device" in summary
    for step in STEPS:
        assert f"{step}: passed" in summary, summary
        assert (out / f"{step}.log").exists()
    assert (out / "gpu-tests.xml").read_text().count("<testcase") > 20  # the gpu tests, skipped
    assert (out / "gpu-tests-c10d.xml").read_text().count("<testcase") >= 3  # the RPC layer's, on c10d
    assert "Not yet measured on a GPU" in (out / "gpu.md").read_text()
    for name in ("pc-distributed-rpc_backends", "pc-pickle", "pc-pool", "pc-sync", "pc-sync-processes"):
        assert (out / "bench" / f"{name}-cuda.json").exists()
    assert '"cuda": false' in (out / "demo.json").read_text()
