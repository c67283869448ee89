"""The main demo (examples/async_training.py) in a short configuration, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[1] / "examples" / "async_training.py"


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(DEMO), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_demo_short_run_converges_and_prints_the_table() -> None:
    proc = _run("--steps", "30", "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "placement of the model's parts (features, head): ['cpu', 'cpu']" in out
    for row in ("pushes in all", "dropped stale gradients", "single-process baseline", "throughput"):
        assert row in out, out
    assert "pushes in all                           60" in out
    assert out.rstrip().endswith("converged")


def test_demo_rejects_bad_flags() -> None:
    proc = _run("--workers", "0", timeout=60)
    assert proc.returncode == 2
    assert "--workers must be >= 1" in proc.stderr


def test_demo_help_documents_the_flags() -> None:
    proc = _run("--help", timeout=60)
    assert proc.returncode == 0
    for flag in ("--workers", "--steps", "--device", "--replicas", "--max-staleness"):
        assert flag in proc.stdout


@pytest.mark.gpu
def test_demo_on_cuda() -> None:
    proc = _run("--steps", "30", "--no-progress", "--device", "cuda")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cuda" in proc.stdout
