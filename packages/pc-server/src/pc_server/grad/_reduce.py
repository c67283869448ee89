"""Pure gradient-reduction functions of the gradient server (no threads, no RPC).

Gradients are grouped by the model version they were computed on. Each group is a :class:`Partial`: the
element-wise *sum* of its gradients and how many pushes it holds. Secondaries reduce pushes into partials, the
primary merges the partials of several secondaries, drops stale groups and finalises:

* ``sum``:  Σ sums
* ``mean``: Σ sums / Σ counts — weighted by pushes, so it is exact for partial batches too (a mean of
  batch means would be exact only for full batches).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch

__all__ = [
    "REDUCE_METHODS",
    "Partial",
    "check_reduce_method",
    "drop_stale",
    "finalize",
    "merge_partials",
    "reduce_pushes",
]

REDUCE_METHODS = ("sum", "mean")


class Partial(NamedTuple):
    """A group of reduced gradients.

    Attributes:
        sums: Parameter names to the element-wise sum of the group's gradients.
        pushes: How many client pushes were summed.
    """

    sums: dict[str, torch.Tensor]
    pushes: int


def check_reduce_method(method: object) -> str:
    """Validate ``reduce_method``: ``"sum"`` or ``"mean"``.

    Raises:
        ValueError: Anything else.
    """
    if method not in REDUCE_METHODS:
        raise ValueError(f"reduce_method must be 'sum' or 'mean', got {method!r}")
    return str(method)


def _add_into(
    acc: dict[str, torch.Tensor], grads: Mapping[str, torch.Tensor], device: torch.device | None
) -> None:
    if acc.keys() != grads.keys():
        missing = sorted(acc.keys() - grads.keys())
        extra = sorted(grads.keys() - acc.keys())
        raise ValueError(
            f"gradient names differ from the first push in the batch: missing {missing}, extra {extra}"
        )
    for name, grad in grads.items():
        into = acc[name]
        if grad.shape != into.shape:  # add_ would broadcast one into the other and sum unlike gradients
            raise ValueError(
                f"gradient {name!r} has shape {tuple(grad.shape)}, the first push in the batch "
                f"{tuple(into.shape)}: gradients of different models cannot be summed"
            )
        into.add_(grad.to(device) if device is not None else grad)


def _start(grads: Mapping[str, torch.Tensor], device: torch.device | None) -> dict[str, torch.Tensor]:
    return {name: g.to(device, copy=True) if device is not None else g.clone() for name, g in grads.items()}


def reduce_pushes(
    pushes: Iterable[tuple[int, Mapping[str, torch.Tensor]]], device: torch.device | str | None = None
) -> dict[int, Partial]:
    """Sum pushes per model version.

    Args:
        pushes: ``(version, grads)`` pairs.
        device: Where to sum (``None``: where the tensors are).

    Returns:
        Version to :class:`Partial`, versions in first-seen order.

    Raises:
        ValueError: Two pushes of the same version carry different parameter names or shapes.
    """
    dev = torch.device(device) if device is not None else None
    groups: dict[int, Partial] = {}
    for version, grads in pushes:
        group = groups.get(version)
        if group is None:
            groups[version] = Partial(_start(grads, dev), 1)
        else:
            _add_into(group.sums, grads, dev)
            groups[version] = Partial(group.sums, group.pushes + 1)
    return groups


def merge_partials(
    parts: Iterable[Mapping[int, Partial]], device: torch.device | str | None = None
) -> dict[int, Partial]:
    """Merge several version-to-partial maps (from several secondaries) into one.

    Args:
        parts: The maps.
        device: Where to sum (``None``: where the tensors are).

    Returns:
        Version to merged :class:`Partial`.

    Raises:
        ValueError: Two partials of the same version carry different parameter names or shapes (secondaries
            that took pushes of different models).
    """
    dev = torch.device(device) if device is not None else None
    merged: dict[int, Partial] = {}
    for part in parts:
        for version, partial in part.items():
            group = merged.get(version)
            if group is None:
                merged[version] = Partial(_start(partial.sums, dev), partial.pushes)
            else:
                _add_into(group.sums, partial.sums, dev)
                merged[version] = Partial(group.sums, group.pushes + partial.pushes)
    return merged


def drop_stale(
    groups: Mapping[int, Partial], head: int, max_staleness: int | None
) -> tuple[dict[int, Partial], int]:
    """Drop the groups computed on versions more than ``max_staleness`` behind ``head``, or ahead of it.

    A version ahead of the head was never published by this server (a client that kept its model across a
    restore from an older checkpoint computed it), so its gradients fit no model the server holds.

    Args:
        groups: Version to partial.
        head: The current model version.
        max_staleness: The bound, or ``None`` for unbounded (no group is too old).

    Returns:
        The kept groups and the number of *pushes* dropped.
    """
    kept = {
        v: g for v, g in groups.items() if v <= head and (max_staleness is None or head - v <= max_staleness)
    }
    dropped = sum(g.pushes for v, g in groups.items() if v not in kept)
    return kept, dropped


def finalize(groups: Mapping[int, Partial], method: str) -> tuple[dict[str, torch.Tensor], int]:
    """Reduce the kept groups into one gradient per parameter.

    Args:
        groups: Version to partial (not empty).
        method: ``"sum"`` or ``"mean"`` (weighted by push counts).

    Returns:
        The gradients and the number of pushes they hold.

    Raises:
        ValueError: ``groups`` is empty or ``method`` unknown.
    """
    check_reduce_method(method)
    if not groups:
        raise ValueError("finalize needs at least one group of gradients")
    merged = merge_partials([groups])
    total: dict[str, torch.Tensor] | None = None
    count = 0
    for partial in merged.values():
        if total is None:
            total = partial.sums
        else:
            _add_into(total, partial.sums, None)
        count += partial.pushes
    if total is None:  # unreachable: groups is not empty
        raise ValueError("finalize needs at least one group of gradients")
    if method == "mean":
        for tensor in total.values():
            tensor.div_(count)
    return total, count
