"""From models to solver items: models sharing a storage are merged, then sized and costed.

Models that share a parameter or buffer storage must live on one device, so they become one item
(:func:`storage_groups`); each item's bytes and compute come from :func:`sizes_and_compute`, and
:func:`check_memory` rejects a problem that cannot fit before any search starts (with the original API's
wording).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from pc_assigner._inputs import check_number
from pc_assigner._sizing import meta_trace, unique_bytes
from pc_assigner.errors import InfeasiblePlacementError
from pc_assigner.estimator import MIB
from pc_assigner.problem import PlacementProblem, fits

__all__ = ["check_memory", "sizes_and_compute", "storage_groups"]


def storage_groups(keysets: list[set[Hashable]]) -> list[list[int]]:
    """Connected components of models that share at least one storage (union-find, in index order)."""
    parent = list(range(len(keysets)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    owner: dict[Hashable, int] = {}
    for i, keys in enumerate(keysets):
        for key in keys:
            if key in owner:
                a, b = find(owner[key]), find(i)
                if a != b:
                    parent[max(a, b)] = min(a, b)
            else:
                owner[key] = i
    comps: dict[int, list[int]] = {}
    for i in range(len(keysets)):
        comps.setdefault(find(i), []).append(i)
    return sorted(comps.values())


def sizes_and_compute(
    models: Sequence[torch.nn.Module],
    groups: list[list[int]],
    multiplier: float,
    model_complexity: Sequence[float | tuple[Any, ...]] | None,
) -> tuple[list[float], list[float]]:
    """Bytes and compute per item (group of models).

    Args:
        models: The models.
        groups: Model indices of each item (see :func:`storage_groups`).
        multiplier: ``model_size_multiplier``: bytes of parameters and buffers times this, when no example
            inputs are given.
        model_complexity: Numbers per model, tuples of example inputs per model, or ``None`` (size).

    Returns:
        ``(sizes, compute)``, one entry per item.
    """
    inputs: list[tuple[Any, ...]] | None = None
    numbers: list[float] | None = None
    if model_complexity is not None:
        if isinstance(model_complexity, (str, bytes)) or not isinstance(model_complexity, Sequence):
            raise TypeError(
                f"model_complexity must be a sequence (numbers or tuples of example inputs), "
                f"got {type(model_complexity).__name__}"
            )
        if len(model_complexity) != len(models):
            raise ValueError(
                f"model_complexity must have one entry per model ({len(models)}), got {len(model_complexity)}"
            )
        if all(isinstance(x, tuple) for x in model_complexity):
            inputs = [x for x in model_complexity if isinstance(x, tuple)]
        elif not any(isinstance(x, tuple) for x in model_complexity):
            numbers = [check_number(f"model_complexity[{i}]", x) for i, x in enumerate(model_complexity)]
        else:
            raise TypeError("model_complexity must be all numbers or all tuples of example inputs, not a mix")
    traces = (
        [meta_trace(mdl, x) for mdl, x in zip(models, inputs, strict=True)] if inputs is not None else None
    )
    sizes: list[float] = []
    compute: list[float] = []
    for members in groups:
        seen: set[Hashable] = set()
        pb = unique_bytes((t for i in members for t in [*models[i].parameters(), *models[i].buffers()]), seen)
        if traces is None:
            size = pb * multiplier
        else:
            grads = unique_bytes(p for i in members for p in models[i].parameters() if p.requires_grad)
            size = pb + 3 * grads + sum(traces[i].activation_bytes for i in members)
        sizes.append(float(size))
        if traces is not None:
            compute.append(float(sum(traces[i].flops for i in members)))
        elif numbers is not None:
            compute.append(sum(numbers[i] for i in members))
        else:
            compute.append(float(size))
    return sizes, compute


def check_memory(problem: PlacementProblem, groups: list[list[int]], devs: list[torch.device]) -> None:
    """Reject a problem whose items cannot fit in total, or with an item that fits on no device.

    Raises:
        InfeasiblePlacementError: naming the shortfall in MiB, with the original API's message.
    """
    usable = problem.eligible
    need = sum(problem.sizes)
    have = sum(problem.capacities[j] for j in usable)
    if not fits(need, have):
        raise InfeasiblePlacementError(
            f"Estimated model will use {need / MIB:.2f} MiB, but only have {have / MIB:.2f} MiB allowed "
            f"memory in total (on {[str(devs[j]) for j in usable]})."
        )
    largest = max(usable, key=lambda j: problem.capacities[j])
    for g, members in enumerate(groups):
        if not fits(problem.sizes[g], problem.capacities[largest]):
            what = f"model {members[0]}" if len(members) == 1 else f"models {members} (sharing storage)"
            raise InfeasiblePlacementError(
                f"{what} will use {problem.sizes[g] / MIB:.2f} MiB, more than any device allows "
                f"(largest: {problem.capacities[largest] / MIB:.2f} MiB on {devs[largest]})"
            )
