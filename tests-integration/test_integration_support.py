"""The support policy (docs/support.md) is the one every pyproject declares and the one CI tests."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]


def _compat_matrix() -> list[tuple[str, str]]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(getattr(t, "id", "") == "COMPAT_MATRIX" for t in targets):
            return [tuple(pair) for pair in ast.literal_eval(node.value)]  # type: ignore[misc]
    raise AssertionError("noxfile.py has no COMPAT_MATRIX")


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def test_every_pyproject_declares_the_tested_floor_and_the_supported_pythons() -> None:
    matrix = _compat_matrix()
    floor = min(_minor(torch) for torch, _ in matrix)
    pyprojects = sorted((ROOT / "packages").glob("*/pyproject.toml"))
    assert len(pyprojects) == 7
    for path in pyprojects:
        project = tomllib.loads(path.read_text())["project"]
        torch_reqs = [d for d in project["dependencies"] if re.match(r"torch\b", d)]
        assert torch_reqs == [f"torch>={floor[0]}.{floor[1]}"], (path, torch_reqs)  # a floor, no cap
        assert project["requires-python"] == f">={PYTHONS[0]}", path
        declared = [c.rsplit(" :: ", 1)[1] for c in project["classifiers"] if re.search(r":: 3\.\d+$", c)]
        assert declared == PYTHONS, (path, declared)


def test_the_matrix_covers_the_floor_the_newest_and_the_extreme_pythons() -> None:
    matrix = _compat_matrix()
    pythons = {python for _, python in matrix}
    assert {PYTHONS[0], PYTHONS[-1]} <= pythons
    # With the pinned CPU build (run on Python 3.11 by every other session), every supported Python is tested.
    assert pythons | {"3.11"} == set(PYTHONS), pythons
    policy = (ROOT / "docs" / "support.md").read_text()
    for torch, python in matrix:
        assert torch in policy, torch
        assert python in policy, python
    floor = min(matrix, key=lambda pair: _minor(pair[0]))[0]
    assert f"from {'.'.join(floor.split('.')[:2])} to the newest" in policy
    ci = (ROOT / ".ci" / "run").read_text()
    assert "nox -s compat" in ci


def test_the_github_workflow_runs_the_same_matrix() -> None:
    workflow = (ROOT / ".github" / "workflows" / "ci.yml").read_text()
    pairs = re.findall(r'\{ torch: "([\d.]+)", python: "([\d.]+)" \}', workflow)
    assert sorted(pairs) == sorted(_compat_matrix())
