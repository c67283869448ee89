"""CPU thread replicas: replicate a module, scatter the inputs, gather the outputs (torch's rules, on CPU).

``torch.nn.parallel``'s ``replicate``, ``Scatter`` and ``Gather`` reject CPU devices. These functions do the
same jobs for ``n`` replicas that live on the CPU and run in threads::

    inputs ──scatter──► chunk 0 ─► replica 0 (shares parameters AND buffers with the module) ─┐
                        chunk 1 ─► replica 1 (shares parameters, cloned buffers)           ─┼─gather─► output
                        ...                                                                 ─┘

Replicas share the original ``Parameter`` objects (leaves), so one backward accumulates straight into the
module's ``.grad`` with no broadcast in between; ``chunk`` and ``cat`` are differentiable views and copies.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.parameter import is_lazy

__all__ = ["gather", "replicate_cpu", "scatter", "scatter_kwargs"]

ModuleT = TypeVar("ModuleT", bound=nn.Module)

_CPU = torch.device("cpu")


def _check_replicable(module: nn.Module) -> None:
    if isinstance(module, torch.jit.ScriptModule):
        raise TypeError(
            f"CPU thread replicas cannot copy a TorchScript module ({type(module).__name__}); "
            "wrap the eager module instead"
        )
    for name, tensor in (*module.named_parameters(), *module.named_buffers()):
        if is_lazy(tensor):
            raise ValueError(
                f"{name} of {type(module).__name__} is an uninitialized lazy tensor; run the module once "
                "on a sample input before wrapping it in a data-parallel module"
            )


def replicate_cpu(module: ModuleT, n: int) -> list[ModuleT]:
    """Make ``n`` shallow replicas of ``module`` for CPU threads.

    Each replica is a new object of each module's class with a shallow copy of its ``__dict__``: the same
    ``Parameter`` objects, its own ``_modules`` dict remapped onto the replica's submodules (so shared
    submodules stay shared), and buffers that are the module's own tensors in replica 0 and clones in the
    others (so, as on CUDA, in-place buffer updates of replica 0 persist and those of the other replicas are
    lost). The original module is never handed out or modified.

    Args:
        module: the module to replicate; its parameters and buffers must be initialized.
        n: the number of replicas (>= 1).

    Returns:
        The replicas, in copy order.

    Raises:
        TypeError: for a TorchScript module.
        ValueError: for ``n < 1`` or uninitialized lazy parameters or buffers.
    """
    if n < 1:
        raise ValueError(f"the number of replicas must be >= 1, got {n}")
    _check_replicable(module)
    originals = list(module.modules())
    replicas: list[ModuleT] = []
    for copy_id in range(n):
        # The attribute names below are nn.Module's storage; torch has no public API that builds a replica
        # sharing parameter leaves (``_replicate_for_data_parallel`` is private and marks replicas unusable).
        by_id: dict[int, nn.Module] = {}
        for original in originals:
            state = original.__dict__.copy()
            state["_parameters"] = dict(original._parameters)
            if copy_id == 0:
                state["_buffers"] = dict(original._buffers)
            else:
                state["_buffers"] = {
                    key: None if buf is None else buf.clone() for key, buf in original._buffers.items()
                }
            replica = original.__new__(type(original))
            replica.__dict__ = state  # bypasses nn.Module.__setattr__, which would re-register every entry
            by_id[id(original)] = replica
        for original in originals:
            by_id[id(original)].__dict__["_modules"] = {
                key: None if sub is None else by_id[id(sub)] for key, sub in original._modules.items()
            }
        replicas.append(by_id[id(module)])  # type: ignore[arg-type]
    return replicas


def _check_dim(tensor: torch.Tensor, dim: int, what: str) -> None:
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(
            f"dim={dim} is out of range for a {what} tensor with {tensor.dim()} dimension(s) "
            f"(shape {tuple(tensor.shape)}); expected -{tensor.dim()} <= dim < {tensor.dim()}"
        )


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def scatter(obj: Any, n: int, dim: int) -> list[Any]:
    """Split ``obj`` into at most ``n`` per-replica pieces, like ``torch.nn.parallel.scatter``.

    Tensors are chunked along ``dim`` (``torch.chunk`` may give fewer than ``n`` chunks) as CPU views; tuples,
    lists, dicts and namedtuples are split element-wise and the shortest split wins; any other object, and
    empty containers, are passed by reference to every replica.

    Raises:
        ValueError: if ``dim`` is out of range for a tensor.
    """
    if isinstance(obj, torch.Tensor):
        _check_dim(obj, dim, "input")
        return [chunk.to(_CPU) for chunk in obj.chunk(n, dim)]
    if _is_namedtuple(obj):
        return [type(obj)(*args) for args in zip(*(scatter(item, n, dim) for item in obj), strict=False)]
    if isinstance(obj, tuple) and obj:
        return list(zip(*(scatter(item, n, dim) for item in obj), strict=False))
    if isinstance(obj, list) and obj:
        return [list(items) for items in zip(*(scatter(item, n, dim) for item in obj), strict=False)]
    if isinstance(obj, dict) and obj:
        return [
            type(obj)(items) for items in zip(*(scatter(item, n, dim) for item in obj.items()), strict=False)
        ]
    return [obj for _ in range(n)]


def scatter_kwargs(
    inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, n: int, dim: int
) -> tuple[tuple[tuple[Any, ...], ...], tuple[dict[str, Any], ...]]:
    """Scatter positional and keyword inputs to the same number of replicas.

    Like torch's ``scatter_kwargs``, a missing side is padded with ``()`` / ``{}``. Unlike it, when both sides
    are present the shorter split wins, so a non-tensor keyword can never add a replica without positional
    inputs.
    """
    scattered_inputs: list[tuple[Any, ...]] = [tuple(x) for x in scatter(inputs, n, dim)] if inputs else []
    scattered_kwargs: list[dict[str, Any]] = scatter(kwargs, n, dim) if kwargs else []
    if scattered_inputs and scattered_kwargs:
        count = min(len(scattered_inputs), len(scattered_kwargs))
        scattered_inputs, scattered_kwargs = scattered_inputs[:count], scattered_kwargs[:count]
    elif scattered_kwargs:
        scattered_inputs = [() for _ in scattered_kwargs]
    else:
        scattered_kwargs = [{} for _ in scattered_inputs]
    return tuple(scattered_inputs), tuple(scattered_kwargs)


def gather(outputs: Sequence[Any], dim: int) -> Any:
    """Combine per-replica outputs on the CPU, like ``torch.nn.parallel.gather``.

    Tensors are concatenated along ``dim`` (0-d tensors are unsqueezed into a vector, with torch's warning);
    dicts are gathered per key, namedtuples, tuples and lists per element; an all-``None`` result stays
    ``None``.

    Raises:
        TypeError: if the replicas returned different types, or a type that cannot be gathered.
        ValueError: if dicts have different keys or ``dim`` is out of range.
    """
    first = outputs[0]
    kinds = {type(out) for out in outputs}
    if len(kinds) > 1 and not all(isinstance(out, torch.Tensor) for out in outputs):
        names = ", ".join(sorted(kind.__name__ for kind in kinds))
        raise TypeError(f"replicas returned outputs of different types ({names}); expected one type")
    if isinstance(first, torch.Tensor):
        if all(out.dim() == 0 for out in outputs):
            warnings.warn(
                f"Was asked to gather along dimension {dim}, but all input tensors were scalars; "
                "will instead unsqueeze and return a vector.",
                UserWarning,
                stacklevel=4,
            )
            return torch.stack([out.to(_CPU) for out in outputs])
        _check_dim(first, dim, "output")
        return torch.cat([out.to(_CPU) for out in outputs], dim)
    if first is None:
        return None
    if isinstance(first, dict):
        if any(out.keys() != first.keys() for out in outputs):
            raise ValueError("All dicts must have the same keys; replicas returned dicts with different keys")
        return type(first)((key, gather([out[key] for out in outputs], dim)) for key in first)
    if _is_namedtuple(first):
        return type(first)._make(gather(list(items), dim) for items in zip(*outputs, strict=True))
    if isinstance(first, (tuple, list)):
        return type(first)(gather(list(items), dim) for items in zip(*outputs, strict=True))
    raise TypeError(
        f"cannot gather replica outputs of type {type(first).__name__}; expected tensors, None, or dicts, "
        "tuples or lists of them"
    )
