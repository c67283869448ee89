"""Counting bytes and FLOPs of modules: small pure functions returning plain ints.

* Bytes come from ``untyped_storage().nbytes()``, once per unique storage (keyed by device and data pointer,
  or by tensor identity on the meta device), so views, tied weights and modules shared between models count
  once, and every dtype is sized by torch itself (bf16 = 2, complex32 = 4, float8 = 1, uint16/32/64, ...).
* Activations and FLOPs come from a forward (and backward) on the **meta device** through
  ``torch.func.functional_call``: the user's parameters are swapped for meta stand-ins for the duration of the
  call, so nothing is allocated, moved or copied.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["MetaTrace", "meta_trace", "storage_key", "tensor_bytes", "unique_bytes"]


def storage_key(t: torch.Tensor) -> Hashable:
    """A key equal for tensors that share memory (views, tied weights)."""
    if t.device.type == "meta" or t.layout != torch.strided:
        return ("id", id(t))
    return (str(t.device), t.untyped_storage().data_ptr())


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes held by ``t``'s storage (dense), or by its values plus indices (sparse layouts)."""
    layout = t.layout
    if layout == torch.strided:
        return int(t.untyped_storage().nbytes())
    if layout == torch.sparse_coo:
        s = t if t.is_coalesced() else t.coalesce()
        return tensor_bytes(s.indices()) + tensor_bytes(s.values())
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return sum(tensor_bytes(x) for x in (t.crow_indices(), t.col_indices(), t.values()))
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return sum(tensor_bytes(x) for x in (t.ccol_indices(), t.row_indices(), t.values()))
    return int(t.numel() * t.dtype.itemsize)


def unique_bytes(tensors: Iterable[torch.Tensor], seen: set[Hashable] | None = None) -> int:
    """Sum of :func:`tensor_bytes` over tensors whose storage is not yet in ``seen`` (updated in place)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        key = storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        total += tensor_bytes(t)
    return total


@dataclass(frozen=True)
class MetaTrace:
    """What one meta-device forward (and backward) of a module revealed.

    Attributes:
        activation_bytes: Sum of the output bytes of every leaf module.
        flops: FLOPs of the forward plus, when something requires grad, the backward of ``out.sum()``.
        forward_flops: FLOPs of the forward alone.
    """

    activation_bytes: int
    flops: int
    forward_flops: int


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, device="meta").requires_grad_(x.requires_grad)
    if isinstance(x, tuple):
        return tuple(_to_meta(v) for v in x)
    if isinstance(x, list):
        return [_to_meta(v) for v in x]
    if isinstance(x, dict):
        return {k: _to_meta(v) for k, v in x.items()}
    return x


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def meta_trace(model: torch.nn.Module, example_inputs: tuple[Any, ...]) -> MetaTrace:
    """Run ``model(*example_inputs)`` on the meta device, counting leaf outputs and FLOPs.

    Args:
        model: The module; its parameters and buffers are neither moved nor copied.
        example_inputs: Positional inputs (tensors anywhere inside are replaced by meta tensors of the same
            shape and dtype).

    Returns:
        The activation bytes and FLOP counts.

    Raises:
        TypeError: if ``example_inputs`` is not a tuple.
        RuntimeError: if the forward fails on the meta device (e.g. it reads tensor values).
    """
    if not isinstance(example_inputs, tuple):
        raise TypeError(
            f"example_inputs must be a tuple of positional inputs, got {type(example_inputs).__name__}"
        )
    state = {
        name: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
        for name, t in [*model.named_parameters(), *model.named_buffers()]
    }
    inputs = _to_meta(example_inputs)
    activation = 0
    handles = []

    def hook(_module: torch.nn.Module, _inp: Any, out: Any) -> None:
        nonlocal activation
        activation += sum(t.numel() * t.dtype.itemsize for t in _tensors(out))

    for module in model.modules():
        if next(module.children(), None) is None:
            handles.append(module.register_forward_hook(hook))
    try:
        counter = FlopCounterMode(display=False)
        with counter:
            out = torch.func.functional_call(model, state, inputs)
            forward_flops = int(counter.get_total_flops())
            grads = [t for t in _tensors(out) if t.requires_grad and t.is_floating_point()]
            if grads:
                loss = sum((t.sum() for t in grads), torch.zeros((), device="meta"))
                loss.backward()  # type: ignore[no-untyped-call]
        flops = int(counter.get_total_flops())
    except Exception as exc:
        raise RuntimeError(
            f"the meta-device forward of {type(model).__name__} failed ({type(exc).__name__}: {exc}); "
            "pass model_complexity as numbers instead of example inputs"
        ) from exc
    finally:
        for h in handles:
            h.remove()
    return MetaTrace(activation_bytes=int(activation), flops=flops, forward_flops=forward_flops)
