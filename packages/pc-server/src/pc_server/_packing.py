"""Packing of tensor dictionaries for transport and storage: small tensors in one flat buffer per dtype.

Every tensor in an RPC message costs 10-70 µs of framing, so a state dict of 100 small tensors costs several
times one tensor of the same size: :func:`pack` concatenates the *small* tensors of each dtype into one CPU
buffer. Large tensors (at least :data:`SEPARATE_BYTES`) are kept as they are: concatenating them would cost a
full extra copy (and a fresh allocation that page-faults), and TensorPipe moves several large tensors faster
than one huge one. With ``copy=False`` a large CPU tensor is not copied at all, which is right when the value
is about to be serialised (an RPC argument): the serialisation is the snapshot, and the receiver owns what it
gets. :func:`unpack` hands back views of the buffers (and the large tensors) shaped like the originals. A
:class:`Packed` value is immutable by convention: nothing in pc-server writes into it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

__all__ = ["SEPARATE_BYTES", "Packed", "pack", "unpack"]

#: Tensors of at least this many bytes are not concatenated into the per-dtype buffers.
SEPARATE_BYTES = 64 * 1024


class Packed(NamedTuple):
    """A tensor dictionary packed for transport: small tensors in one flat CPU buffer per dtype.

    Attributes:
        names: The tensor entries' names, in the original order.
        shapes: The shape of each named tensor.
        dtypes: The dtype of each named tensor.
        buffers: One flat, contiguous CPU tensor per dtype, holding that dtype's small tensors in ``names``
            order.
        extras: Entries that are not tensors (e.g. a module's ``_extra_state``), kept as they are.
        large: Names to the large tensors, each a contiguous CPU tensor of its own (not in ``buffers``).
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    buffers: dict[torch.dtype, torch.Tensor]
    extras: dict[str, Any]
    large: dict[str, torch.Tensor]

    def numel(self) -> int:
        """Total number of tensor elements held."""
        return sum(int(b.numel()) for b in self.buffers.values()) + sum(
            int(t.numel()) for t in self.large.values()
        )


def _is_compact(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is contiguous and spans its whole storage (so it travels without waste)."""
    return (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


def _large_part(tensor: torch.Tensor, copy: bool) -> torch.Tensor:
    """A contiguous CPU version of a large tensor: a fresh copy if ``copy`` (or if needed), else itself."""
    if tensor.device.type != "cpu":
        return tensor.to("cpu", memory_format=torch.contiguous_format)  # a copy already
    if copy or not _is_compact(tensor):
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def pack(tensors: Mapping[str, Any], *, copy: bool = True, separate_bytes: int = SEPARATE_BYTES) -> Packed:
    """Pack a mapping of names to tensors into a :class:`Packed` value on the CPU.

    Args:
        tensors: Names to tensors (any device); values that are not tensors go to ``extras`` unchanged.
        copy: Return a private copy (nothing shared with ``tensors``). With ``False`` large contiguous CPU
            tensors are kept (detached) as they are: only for values serialised right away, like RPC
            arguments, whose receiver gets its own copy.
        separate_bytes: Tensors of at least this many bytes are kept separate instead of concatenated.

    Returns:
        The packed value.

    Raises:
        TypeError: If ``tensors`` is not a mapping or a name is not a string.
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(f"expected a mapping of names to tensors, got {type(tensors).__name__}")
    names: list[str] = []
    shapes: list[tuple[int, ...]] = []
    dtypes: list[torch.dtype] = []
    parts: dict[torch.dtype, list[torch.Tensor]] = {}
    large: dict[str, torch.Tensor] = {}
    extras: dict[str, Any] = {}
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r} ({type(name).__name__})")
        if not isinstance(value, torch.Tensor):
            extras[name] = value
            continue
        tensor = value.detach()
        names.append(name)
        shapes.append(tuple(tensor.shape))
        dtypes.append(tensor.dtype)
        if tensor.layout == torch.strided and tensor.numel() * tensor.element_size() >= separate_bytes:
            large[name] = _large_part(tensor, copy)
        else:
            parts.setdefault(tensor.dtype, []).append(tensor.reshape(-1).to("cpu"))
    buffers = {dtype: torch.cat(chunks) for dtype, chunks in parts.items()}  # torch.cat always allocates
    return Packed(tuple(names), tuple(shapes), tuple(dtypes), buffers, extras, large)


def unpack(packed: Packed, device: torch.device | str | None = None) -> dict[str, Any]:
    """Unpack a :class:`Packed` value into a dict of tensors shaped like the originals.

    The tensors are views of the packed buffers or the packed large tensors themselves (moved to ``device``
    first when given), so the caller must copy them (``load_state_dict`` does) before anybody writes into
    them.

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
    large = packed.large
    out: dict[str, Any] = {}
    for name, shape, dtype in zip(packed.names, packed.shapes, packed.dtypes, strict=True):
        single = large.get(name)
        if single is not None:
            out[name] = (single if device is None else single.to(device)).view(shape)
            continue
        numel = 1
        for dim in shape:
            numel *= dim
        start = offsets[dtype]
        out[name] = buffers[dtype][start : start + numel].view(shape)
        offsets[dtype] = start + numel
    out.update(packed.extras)
    return out
