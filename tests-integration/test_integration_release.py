"""Releasing through a real package index, then installing each package alone from it.

A copy of the packages is released with tools/release.py (the logic of ``nox -s release``) to a pypiserver on
loopback, in dependency order; then every package is installed by name into a fresh venv, and exactly its
closure of siblings must arrive. A patch release of pc-pickle alone is then picked up by ``pip install -U
pc-pool`` without touching pc-pool itself.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from release_index import Venv, package_index

ROOT = Path(__file__).resolve().parents[1]
RELEASE = ROOT / "tools" / "release.py"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),  # seven builds, uploads and fresh venvs; minutes on a loaded 2-core machine
    pytest.mark.skipif(
        not all(
            importlib.util.find_spec(m) for m in ("pypiserver", "build", "twine", "hatchling", "packaging")
        ),
        reason="needs pypiserver, build, twine, hatchling and packaging (installed by nox -s tests)",
    ),
]

# What each package must pull in, written out by hand (the oracle, not computed from the pyproject files).
CLOSURES = {
    "pc-pickle": {"pc-pickle"},
    "pc-pool": {"pc-pickle", "pc-pool"},
    "pc-distributed": {"pc-pickle", "pc-distributed"},
    "pc-server": {"pc-pickle", "pc-distributed", "pc-server"},
    "pc-replicate": {"pc-replicate"},
    "pc-sync": {"pc-sync"},
    "pc-assigner": {"pc-assigner"},
}
SMOKE = {
    "pc-pickle": "import pc_pickle; assert pc_pickle.loads(pc_pickle.dumps(lambda x: x + 1))(1) == 2",
    "pc-pool": "import pc_pool\nwith pc_pool.ThreadPool(2) as p:\n    assert p.map(abs, [-1, 2]) == [1, 2]",
    "pc-distributed": "import pc_distributed; assert callable(pc_distributed.run_world)",
    "pc-server": "import pc_server; assert pc_server.PushPullGradServerImpl",
    "pc-replicate": "import torch, pc_replicate; assert pc_replicate.ReplicationCallbackDataParallel",
    "pc-sync": "import torch, pc_sync; assert pc_sync.SynchronizedBatchNorm1d(3)(torch.ones(4, 3)).ndim == 2",
    "pc-assigner": "import pc_assigner; assert pc_assigner.ModelAssigner",
}
ORDER = ["pc-pickle", "pc-pool", "pc-distributed", "pc-server", "pc-replicate", "pc-sync", "pc-assigner"]


def _release_tool(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(RELEASE), "--root", str(root), *args]
    env = {**os.environ, "TWINE_USERNAME": "pc-test", "TWINE_PASSWORD": "unused"}  # the index takes any
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, env=env)


def _copy_packages(dest: Path) -> Path:
    """The packages (sources and metadata, no tests or benchmarks), as a release checkout would have them."""
    ignore = shutil.ignore_patterns("tests", "benchmarks", "__pycache__", "*.pyc", "dist")
    shutil.copytree(ROOT / "packages", dest / "packages", ignore=ignore)
    return dest


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the packages, each one's CHANGELOG finalized for its current version (a first release)."""
    root = _copy_packages(tmp_path_factory.mktemp("release") / "repo")
    for name in ORDER:
        proc = _release_tool(root, "bump", name, _current(root, name))
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return root


@pytest.fixture
def index(tmp_path: Path) -> Iterator[str]:
    """A fresh, empty package index on loopback; its base URL."""
    (tmp_path / "index").mkdir()
    with package_index(tmp_path / "index") as base:
        yield base


def _release(root: Path, base: str, name: str) -> subprocess.CompletedProcess[str]:
    return _release_tool(
        root,
        "release",
        name,
        "--no-isolation",
        "--dist",
        str(root / "dist"),
        "--index-url",
        base + "simple/",
        "--repository-url",
        base,
    )


def test_release_refuses_a_sibling_range_the_index_cannot_satisfy(repo: Path, index: str) -> None:
    root, base = repo, index
    refused = _release(root, base, "pc-server")  # pc-distributed was never published
    assert refused.returncode == 1
    assert "pc-distributed" in refused.stderr
    assert "no version" in refused.stderr
    assert not (root / "dist" / "pc-server").exists() or not any((root / "dist" / "pc-server").iterdir())


def test_every_package_installs_alone_with_exactly_its_closure(
    repo: Path, index: str, tmp_path: Path
) -> None:
    root, base = repo, index
    for name in ORDER:
        proc = _release(root, base, name)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    again = _release(root, base, "pc-pickle")
    assert again.returncode == 1
    assert "already on" in again.stderr
    venvs = {}
    for name in ORDER:
        venv = venvs[name] = Venv(tmp_path / name, ROOT / "constraints" / "cpu.txt")
        venv.install(base + "simple/", name)
        installed = venv.distributions()
        assert set(installed) == CLOSURES[name], f"{name}: {installed}"
        venv.run(SMOKE[name])

    # a patch release of pc-pickle alone; pc-pool's users pick it up with -U, pc-pool itself unchanged
    changelog = root / "packages" / "pc-pickle" / "CHANGELOG.md"
    changelog.write_text(changelog.read_text().replace("## Unreleased\n", "## Unreleased\n\n- A fix.\n", 1))
    bumped = _release_tool(root, "bump", "pc-pickle", "patch")
    assert bumped.returncode == 0, bumped.stderr
    proc = _release(root, base, "pc-pickle")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pool = venvs["pc-pool"]
    before = pool.distributions()
    pool.install(base + "simple/", "pc-pool", upgrade=True)
    after = pool.distributions()
    assert after["pc-pool"] == before["pc-pool"]
    assert after["pc-pickle"] == _bumped(before["pc-pickle"])
    pool.run(SMOKE["pc-pool"])


def _current(root: Path, name: str) -> str:
    about = root / "packages" / name / "src" / name.replace("-", "_") / "__about__.py"
    return about.read_text().split('__version__ = "', 1)[1].split('"', 1)[0]


def _bumped(version: str) -> str:
    major, minor, patch = version.split(".")
    return f"{major}.{minor}.{int(patch) + 1}"
