"""Packing of tensor dictionaries into one flat buffer per dtype, for transport and storage.

Every tensor in an RPC message costs 10-70 µs of framing, so a state dict of 100 small tensors costs several
times one tensor of the same size. :func:`pack` concatenates the tensors of each dtype into one CPU buffer
(which is also the snapshot copy: ``torch.cat`` always allocates), and :func:`unpack` hands back views of
those buffers shaped like the originals. A :class:`Packed` value is immutable by convention: nothing in
pc-server writes into it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

__all__ = ["Packed", "pack", "unpack"]


class Packed(NamedTuple):
    """A tensor dictionary packed into one flat CPU buffer per dtype.

    Attributes:
        names: The tensor entries' names, in the original order.
        shapes: The shape of each named tensor.
        dtypes: The dtype of each named tensor.
        buffers: One flat, contiguous CPU tensor per dtype, holding that dtype's tensors in ``names`` order.
        extras: Entries that are not tensors (e.g. a module's ``_extra_state``), kept as they are.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    buffers: dict[torch.dtype, torch.Tensor]
    extras: dict[str, Any]

    def numel(self) -> int:
        """Total number of tensor elements held."""
        return sum(int(b.numel()) for b in self.buffers.values())


def pack(tensors: Mapping[str, Any]) -> Packed:
    """Pack a mapping of names to tensors into a :class:`Packed` value (a fresh CPU copy).

    Args:
        tensors: Names to tensors (any device); values that are not tensors go to ``extras`` unchanged.

    Returns:
        The packed copy.

    Raises:
        TypeError: If ``tensors`` is not a mapping or a name is not a string.
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"expected a mapping of names to tensors, got {type(tensors).__name__}")
    names: list[str] = []
    shapes: list[tuple[int, ...]] = []
    dtypes: list[torch.dtype] = []
    parts: dict[torch.dtype, list[torch.Tensor]] = {}
    extras: dict[str, Any] = {}
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r} ({type(name).__name__})")
        if not isinstance(value, torch.Tensor):
            extras[name] = value
            continue
        names.append(name)
        shapes.append(tuple(value.shape))
        dtypes.append(value.dtype)
        parts.setdefault(value.dtype, []).append(value.detach().reshape(-1).to("cpu"))
    buffers = {dtype: torch.cat(chunks) for dtype, chunks in parts.items()}
    return Packed(tuple(names), tuple(shapes), tuple(dtypes), buffers, extras)


def unpack(packed: Packed, device: torch.device | str | None = None) -> dict[str, Any]:
    """Unpack a :class:`Packed` value into a dict of tensors shaped like the originals.

    The tensors are views of the packed buffers (moved to ``device`` first when given), so the caller must
    copy
    them (``load_state_dict`` does) before anybody writes into the buffers.

    Args:
        packed: The packed value.
        device: Where the tensors should live; ``None`` keeps them on the CPU.

    Returns:
        Names to tensors, in the original order, followed by the extras.

    Raises:
        TypeError: If ``packed`` is not a :class:`Packed` value.
    """
    if not isinstance(packed, Packed):
        raise TypeError(f"expected a pc_server Packed value, got {type(packed).__name__}")
    buffers = {dt: (b if device is None else b.to(device)) for dt, b in packed.buffers.items()}
    offsets = dict.fromkeys(buffers, 0)
    out: dict[str, Any] = {}
    for name, shape, dtype in zip(packed.names, packed.shapes, packed.dtypes, strict=True):
        numel = 1
        for dim in shape:
            numel *= dim
        start = offsets[dtype]
        out[name] = buffers[dtype][start : start + numel].view(shape)
        offsets[dtype] = start + numel
    out.update(packed.extras)
    return out
