"""Private snapshots of values: tensors are detached and cloned, containers rebuilt, the rest deep-copied.

The ordered server stores values that nobody else can reach. A remote push already arrives as a fresh object;
an in-process push goes through :func:`snapshot` *before* the store's lock is taken, so a large copy never
blocks other pushers.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["snapshot"]


def snapshot(value: Any) -> Any:
    """Return a copy of ``value`` that shares no mutable state with it.

    Tensors are detached and cloned (``copy.deepcopy`` refuses non-leaf tensors that require grad); dicts,
    lists, tuples and named tuples are rebuilt with copied items; anything else goes through
    ``copy.deepcopy``.

    Args:
        value: Any picklable value.

    Returns:
        The copy.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        out = copy.copy(value)  # keeps the mapping type (OrderedDict, defaultdict)
        for key, item in value.items():
            out[key] = snapshot(item)
        return out
    if isinstance(value, list):
        return [snapshot(item) for item in value]
    if isinstance(value, tuple):
        items = [snapshot(item) for item in value]
        if hasattr(value, "_fields"):  # a named tuple
            return type(value)(*items)
        return type(value)(items)
    return copy.deepcopy(value)
