"""tools/release.py's checks and version bumps, on a copy of one package (no build, no index)."""

from __future__ import annotations

import datetime
import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("packaging") is None, reason="needs packaging (installed by nox -s tests)"
)


@pytest.fixture
def tool() -> object:
    spec = importlib.util.spec_from_file_location("pc_release_tool", ROOT / "tools" / "release.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["pc_release_tool"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("pc_release_tool", None)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    for name in ("pc-pickle", "pc-pool"):
        shutil.copytree(
            ROOT / "packages" / name,
            tmp_path / "packages" / name,
            ignore=shutil.ignore_patterns("tests", "benchmarks", "__pycache__"),
        )
    return tmp_path


def _write_changelog(repo: Path, name: str, text: str) -> Path:
    path = repo / "packages" / name / "CHANGELOG.md"
    path.write_text(f"# Changelog of {name}\n\n{text}")
    return path


def test_bump_moves_unreleased_entries_under_the_new_version(tool: object, repo: Path) -> None:
    changelog = _write_changelog(
        repo, "pc-pickle", "## Unreleased\n\n- New thing.\n\n## 0.1.0 — 2026-01-01\n\n- Old.\n"
    )
    new = tool.bump(repo, "pc-pickle", "minor", today=datetime.date(2026, 11, 24))  # type: ignore[attr-defined]
    assert new == "0.2.0"
    assert changelog.read_text() == (
        "# Changelog of pc-pickle\n\n## Unreleased\n\n## 0.2.0 — 2026-11-24\n\n- New thing.\n"
        "\n## 0.1.0 — 2026-01-01\n\n- Old.\n"
    )
    about = repo / "packages" / "pc-pickle" / "src" / "pc_pickle" / "__about__.py"
    assert '__version__ = "0.2.0"' in about.read_text()
    assert tool.load_package(repo, "pc-pickle").version() == "0.2.0"  # type: ignore[attr-defined]


def test_bump_refusals_name_the_problem(tool: object, repo: Path) -> None:
    error = tool.ReleaseError  # type: ignore[attr-defined]
    _write_changelog(repo, "pc-pickle", "## Unreleased\n\n## 0.1.0 — 2026-01-01\n\n- Old.\n")
    with pytest.raises(error, match="nothing under '## Unreleased'"):
        tool.bump(repo, "pc-pickle", "patch")  # type: ignore[attr-defined]
    with pytest.raises(error, match=r"must be greater than 0.1.0"):
        tool.bump(repo, "pc-pickle", "0.1.0")  # type: ignore[attr-defined]
    with pytest.raises(error, match=r"must be greater than 0.1.0"):
        tool.bump(repo, "pc-pickle", "0.0.9")  # type: ignore[attr-defined]
    with pytest.raises(error, match=r"give major, minor, patch or X.Y.Z"):
        tool.bump(repo, "pc-pickle", "huge")  # type: ignore[attr-defined]
    with pytest.raises(error, match="no package 'pc-nothing'"):
        tool.bump(repo, "pc-nothing", "patch")  # type: ignore[attr-defined]


def test_release_checks_tag_changelog_and_sibling_ranges(tool: object, repo: Path) -> None:
    error = tool.ReleaseError  # type: ignore[attr-defined]
    _write_changelog(repo, "pc-pool", "## Unreleased\n\n- Things.\n")
    with pytest.raises(error, match=r"tag 'pc-pool-v9.9.9' does not match pc-pool 0.1.0"):
        tool.release(repo, "pc-pool", tag="pc-pool-v9.9.9")  # type: ignore[attr-defined]
    with pytest.raises(error, match=r"has no '## 0.1.0' section"):
        tool.release(repo, "pc-pool", tag="pc-pool-v0.1.0")  # type: ignore[attr-defined]
    _write_changelog(repo, "pc-pool", "## Unreleased\n\n## 0.1.0 — 2026-11-24\n\n- Things.\n")
    with pytest.raises(error, match="needs --index-url"):
        tool.release(repo, "pc-pool", repository_url="http://127.0.0.1:9/")  # type: ignore[attr-defined]
    package = tool.load_package(repo, "pc-pool")  # type: ignore[attr-defined]
    problems = tool.sibling_problems(package, {"pc-pickle": {"0.2.0", "0.0.9"}})  # type: ignore[attr-defined]
    assert problems == [
        "pc-pool needs pc-pickle>=0.1,<0.2, but the index has ['0.0.9', '0.2.0'] of pc-pickle"
    ]
    assert tool.sibling_problems(package, {"pc-pickle": {"0.1.7"}}) == []  # type: ignore[attr-defined]


def test_simple_index_file_names_are_parsed(tool: object) -> None:
    parse = tool._name_version  # type: ignore[attr-defined]
    assert parse("pc_pickle-0.1.1-py3-none-any.whl") == ("pc_pickle", "0.1.1")
    assert parse("pc_pickle-0.1.1.tar.gz") == ("pc_pickle", "0.1.1")
    assert parse("pc-pickle-0.1.0rc1.tar.gz") == ("pc_pickle", "0.1.0rc1")
    assert parse("README.html") is None
