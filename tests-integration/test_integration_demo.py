"""The main demo (examples/async_training.py) in a short configuration, as a user runs it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[1] / "examples" / "async_training.py"


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(DEMO), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_demo_on_digits_reaches_the_accuracy_bar_and_saves_a_plot(tmp_path: Path) -> None:
    plot = tmp_path / "curves.png"
    proc = _run("--steps", "40", "--plot", str(plot))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "digits (1437 training / 360 held-out images)" in out
    assert "placement of the model's parts (features, head): ['cpu', 'cpu']" in out
    assert re.search(r"^pushes in all +80$", out, re.M), out
    ledger = re.search(r"^ledger: accepted / refused as stale +(\d+) / (\d+)$", out, re.M)
    assert ledger, out
    assert int(ledger.group(1)) + int(ledger.group(2)) == 80  # every push answered: taken or refused
    kept = re.search(r"^ledger: applied / dropped +(\d+) / (\d+)$", out, re.M)
    assert kept, out
    assert int(kept.group(1)) + int(kept.group(2)) == int(
        ledger.group(1)
    )  # every accepted push accounted for
    accuracy = float(re.search(r"held-out accuracy: pc, asynchronous\s+([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    baseline = float(re.search(r"held-out accuracy: single-process baseline\s+([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    assert accuracy >= 0.95
    assert accuracy >= baseline - 0.02
    assert out.rstrip().endswith(f"plot saved to {plot}")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # stderr is a pipe here: progress comes as plain lines, never terminal escape codes
    assert "worker 1: step 40/40" in proc.stderr
    assert "\x1b[" not in proc.stderr
    assert "\r" not in proc.stderr


def test_demo_fails_below_the_accuracy_bar(tmp_path: Path) -> None:
    # one step per worker cannot reach 0.95: the run must say so and exit 1
    proc = _run("--steps", "1", "--no-progress", "--plot", "")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "DID NOT CONVERGE: accuracy" in proc.stdout


def test_demo_rejects_bad_flags() -> None:
    proc = _run("--workers", "0", timeout=60)
    assert proc.returncode == 2
    assert "--workers must be >= 1" in proc.stderr


def test_demo_help_documents_the_flags() -> None:
    proc = _run("--help", timeout=60)
    assert proc.returncode == 0
    for flag in ("--workers", "--steps", "--device", "--replicas", "--max-staleness", "--plot"):
        assert flag in proc.stdout


@pytest.mark.gpu
def test_demo_on_cuda() -> None:
    proc = _run("--steps", "30", "--no-progress", "--plot", "", "--device", "cuda")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cuda" in proc.stdout
