"""Task functions of the pc-pool benchmark that live in an importable module, so pc_pickle pickles them by
name (``run.py`` runs as ``__main__``, whose functions it pickles by value, with the globals they use)."""

from __future__ import annotations

import torch


def add_one(t: torch.Tensor) -> None:
    """An in-place add on a shared tensor (the by-name twin of ``run.add_one``)."""
    t.add_(1)


def triple(x: int) -> int:
    """``3 * x`` (the by-name twin of the closure ``run.make_scaler(3)``)."""
    return 3 * x
