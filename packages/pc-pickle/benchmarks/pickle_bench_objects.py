"""Objects for the pc-pickle benchmark that live in an importable module, so every peer pickles their class
by reference (``run.py`` runs as ``__main__``, whose classes pc_pickle and cloudpickle carry by value)."""

from __future__ import annotations

from typing import Any


class Point:
    """A small plain object (goes through reducer_override, unlike dicts)."""

    def __init__(self, i: int) -> None:
        self.x = i
        self.y = float(i) / 3
        self.label = f"p{i}"


def small_objects(cls: type, n: int = 10_000) -> list[Any]:
    """``n`` small objects: half instances of ``cls`` (built with ``cls(i)``), half small dicts."""
    return [cls(i) if i % 2 else {"id": i, "name": f"n{i}", "v": (i, 0.5)} for i in range(n)]
