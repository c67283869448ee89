"""Module size: a prompt to review cohesion above 600 lines, a failure only above 1000 (CONTRIBUTING.md).

A long module that holds one concept is fine; the review threshold only lists the modules worth a second look
(shown with ``pytest -rP``). The hard cap stops a module from growing past what one can review in a sitting.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REVIEW_LINES = 600
HARD_CAP_LINES = 1000


def module_sizes() -> dict[str, int]:
    """Line count of every source module of every package, keyed by its path from the repository root."""
    return {
        str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines())
        for path in sorted(ROOT.glob("packages/pc-*/src/pc_*/**/*.py"))
    }


def test_no_module_is_past_the_hard_cap() -> None:
    sizes = module_sizes()
    assert len(sizes) > 7, "no package sources found"
    for path, lines in sorted(sizes.items(), key=lambda item: -item[1]):
        if lines > REVIEW_LINES:
            print(f"review cohesion: {path} has {lines} lines (> {REVIEW_LINES})")
    too_long = {path: lines for path, lines in sizes.items() if lines > HARD_CAP_LINES}
    assert not too_long, f"modules past the hard cap of {HARD_CAP_LINES} lines (split by concept): {too_long}"
