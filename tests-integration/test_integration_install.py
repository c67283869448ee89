"""Installing one package from a clone, as README.md documents it: a wheelhouse, then ``pip --find-links``.

In a fresh venv (``python -m venv``, so pip comes from ensurepip), the wheels of pc-pool and its sibling
pc-pickle are built into a wheelhouse with ``pip wheel --no-deps`` (what ``nox -s build`` puts in ``dist/``),
then ``pip install --find-links WHEELHOUSE pc-pool`` is resolved with ``--dry-run --report``: both siblings
must come from the wheelhouse. The resolution is the part that failed before (``No matching distribution
found for pc-pickle``); unpacking torch into the venv would add minutes and prove nothing about the clone.
Third-party requirements (torch, dill) come from wherever pip is configured to look; torch is held to the
CPU build of ``constraints/cpu.txt`` like every nox session.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str | Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    env.pop("PYTHONPATH", None)  # the fresh venv must not see the sources of the clone
    proc = subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"{args}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc


@pytest.mark.slow
@pytest.mark.timeout(600)  # three pip runs; 90 s on a loaded 2-core machine
@pytest.mark.skipif(importlib.util.find_spec("ensurepip") is None, reason="this Python has no ensurepip")
def test_install_one_package_with_its_siblings_from_a_wheelhouse(tmp_path: Path) -> None:
    venv, wheelhouse, report = tmp_path / "venv", tmp_path / "dist", tmp_path / "report.json"
    _run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    _run(
        python,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--wheel-dir",
        wheelhouse,
        "packages/pc-pickle",
        "packages/pc-pool",
    )
    # A --find-links on the command line replaces pip's configured ones: hand those on as well.
    configured = _run(python, "-m", "pip", "config", "get", "global.find-links", timeout=60).stdout.split()
    links = [arg for link in [str(wheelhouse), *configured] for arg in ("--find-links", link)]
    _run(
        python, "-m", "pip", "install", "--dry-run", "-q", "--report", report, *links,
        "-c", "constraints/cpu.txt", "pc-pool",
    )  # fmt: skip
    chosen = {
        item["metadata"]["name"]: item["download_info"]["url"]
        for item in json.loads(report.read_text())["install"]
    }
    for name in ("pc-pool", "pc-pickle"):
        assert name in chosen, sorted(chosen)
        assert chosen[name].startswith(wheelhouse.as_uri()), (name, chosen[name])
    assert "torch" in chosen  # the resolution went through pc-pool's third-party requirements too
