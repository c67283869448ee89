"""No import cycle inside any of the seven packages (every import counts: module level, lazy, TYPE_CHECKING).

The imports are read from the sources with ``ast`` (nothing is imported), so a cycle hidden behind a lazy
import inside a function, or behind ``if TYPE_CHECKING:``, fails the test as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[2]
SOURCES = sorted(PACKAGES.glob("pc-*/src/pc_*"))


def _module_name(src: Path, path: Path) -> str:
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every module named by an import statement anywhere in ``tree`` (relative imports resolved)."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            # ``from pkg import sub`` imports the submodule ``pkg.sub`` when there is one.
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def import_graph(src: Path) -> dict[str, set[str]]:
    """Module -> the modules of its own package it imports (the package's ``__init__`` is no target)."""
    files = {_module_name(src, p): p for p in src.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        targets = _imports(tree, name, path.name == "__init__.py")
        # The package itself (its __init__) re-exports everything; importing a sibling through it is what
        # Python does for ``from pkg import x`` anyway, so edges go to concrete modules only.
        graph[name] = {t for t in targets if t in files and t != src.name and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_the_seven_packages_are_found() -> None:
    assert len(SOURCES) == 7, SOURCES


@pytest.mark.parametrize("src", SOURCES, ids=[s.name for s in SOURCES])
def test_no_import_cycle(src: Path) -> None:
    graph = import_graph(src)
    assert graph, f"no modules found under {src}"
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle in {src.name}: {' -> '.join(cycle or [])}"


def test_the_checker_finds_a_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "pc_demo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pc_demo.b import g\n")
    (pkg / "b.py").write_text("def g():\n    from . import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pc_demo.a\n")
    graph = import_graph(pkg)
    assert graph["pc_demo.a"] == {"pc_demo.b"}
    assert graph["pc_demo.b"] == {"pc_demo.a"}
    assert graph["pc_demo.c"] == {"pc_demo.a"}
    assert find_cycle(graph) == ["pc_demo.a", "pc_demo.b", "pc_demo.a"]
    del graph["pc_demo.b"]
    assert find_cycle(graph) is None


# pc_distributed's layers (CONTRIBUTING.md, "The layout of pc-distributed"): what each part may not import.
_FORBIDDEN = {
    "": ("world", "rpc", "collective", "parallel"),  # the bottom layer imports no subpackage
    "rpc": ("world", "collective", "parallel"),
    "collective": ("world", "rpc", "parallel"),
    "parallel": ("world", "rpc", "collective"),
}


def _part(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"  # the package's __init__ re-exports from every subpackage
    # pc_distributed.<sub>[.<mod>]; the root's own modules are all underscored
    return "" if parts[1].startswith("_") else parts[1]


def test_pc_distributed_layers_point_down() -> None:
    src = next(s for s in SOURCES if s.name == "pc_distributed")
    graph = import_graph(src)
    assert {_part(m) for m in graph} >= {"", "world", "rpc", "collective", "parallel"}
    wrong = [
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if _part(target) in _FORBIDDEN.get(_part(module), ())
    ]
    assert not wrong, f"imports against pc_distributed's layers: {wrong}"
