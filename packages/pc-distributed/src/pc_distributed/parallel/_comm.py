"""The collectives DataParallel and DASO issue on a process group: the group, state broadcast, replica checks.

The data-parallel classes talk to ``torch.distributed`` through these functions. Only public torch APIs are
used (ranks are translated with ``dist.get_global_rank``, tensors flattened with ``torch.cat`` rather than the
private ``torch._utils`` helpers); anything private or version-specific belongs in
:mod:`pc_distributed._torch_dist`, the package's one torch-facing module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "CommLike",
    "broadcast_tensors",
    "check_replicas",
    "group_global_ranks",
    "group_size",
    "resolve_group",
    "to_timedelta",
    "wait_work",
]

#: What the data-parallel classes accept as ``comm``: a ``CollectiveGroup``, a ``ProcessGroup`` or ``None``.
CommLike = Any

# Attribute names under which a wrapper (pc_distributed.CollectiveGroup) may hold its torch ProcessGroup.
_WRAPPED_GROUP_ATTRS = ("group", "process_group", "pg")


def resolve_group(comm: CommLike) -> dist.ProcessGroup:
    """Return the torch process group that ``comm`` stands for.

    Args:
        comm: ``None`` for the default (world) group, a ``torch.distributed.ProcessGroup``, or an object that
            wraps one (such as :class:`pc_distributed.CollectiveGroup`).

    Returns:
        The torch process group.

    Raises:
        RuntimeError: If ``torch.distributed`` is not initialised.
        TypeError: If ``comm`` is none of the accepted kinds.
        ValueError: If this process is not a member of the group.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: create a pc_distributed.World (or call "
            "torch.distributed.init_process_group) before building a data-parallel wrapper"
        )
    if comm is None:
        group = dist.group.WORLD
    elif isinstance(comm, dist.ProcessGroup):
        group = comm
    else:
        is_member = getattr(comm, "is_member", None)
        if callable(is_member) and not is_member():
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not a member of the given comm group"
            )
        group = None
        for attr in _WRAPPED_GROUP_ATTRS:
            candidate = getattr(comm, attr, None)
            if isinstance(candidate, dist.ProcessGroup):
                group = candidate
                break
        if group is None:
            raise TypeError(
                "comm must be None (the default group), a torch.distributed.ProcessGroup or a "
                f"pc_distributed.CollectiveGroup, got {type(comm).__name__}"
            )
    if group is None or dist.get_rank(group) < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the given comm group"
        )
    return group


def group_size(group: dist.ProcessGroup) -> int:
    """The number of ranks in ``group``."""
    return int(dist.get_world_size(group))


def group_global_ranks(group: dist.ProcessGroup) -> list[int]:
    """The global ranks of ``group``'s members, indexed by group rank."""
    return [int(dist.get_global_rank(group, i)) for i in range(group_size(group))]


def to_timedelta(timeout: float | None) -> timedelta | None:
    """Convert seconds to a ``timedelta`` (``None`` stays ``None``: the process group's timeout applies)."""
    if timeout is None:
        return None
    return timedelta(seconds=float(timeout))


def wait_work(work: Any, timeout: timedelta | None) -> None:
    """Wait for an async collective, bounded by ``timeout`` or else by the process group's timeout."""
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def _group_by_kind(
    tensors: Iterable[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


@torch.no_grad()
def broadcast_tensors(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, src_group_rank: int = 0
) -> None:
    """Overwrite ``tensors`` in place with the values held by ``src_group_rank``, one collective per dtype.

    Every member must pass tensors of the same shapes, dtypes and order.

    Args:
        tensors: The tensors to synchronise (parameters, buffers).
        group: The process group.
        src_group_rank: The group rank whose values win.
    """
    if not tensors or group_size(group) == 1:
        return
    src = int(dist.get_global_rank(group, src_group_rank))
    for same_kind in _group_by_kind(tensors).values():
        flat = _flatten(same_kind)
        dist.broadcast(flat, src=src, group=group)
        _unflatten_into(flat, same_kind)


def _signature_hash(module: nn.Module) -> int:
    """A process-independent hash of the names, shapes and dtypes of a module's parameters and buffers."""
    parts = [f"p:{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}" for n, p in module.named_parameters()]
    parts += [f"b:{n}:{tuple(b.shape)}:{b.dtype}" for n, b in module.named_buffers()]
    digest = hashlib.sha256("\n".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 62) - 1)


def check_replicas(
    module: nn.Module, group: dist.ProcessGroup, device: torch.device, local_error: Exception | None = None
) -> None:
    """Check collectively that every rank holds the same model structure and passed its local checks.

    Every member exchanges a hash of its parameter and buffer names/shapes/dtypes plus a flag saying whether
    its own argument checks failed. All ranks therefore raise together (instead of one raising and the others
    hanging in the next collective).

    Args:
        module: The local replica.
        group: The process group.
        device: The device the group's backend communicates on.
        local_error: The error this rank found in its own arguments, if any; it is raised on this rank.

    Raises:
        Exception: ``local_error`` on the rank that found it.
        ValueError: On the other ranks when some rank failed its checks, and on every rank when the models
            differ.
    """
    size = group_size(group)
    mine = torch.tensor([_signature_hash(module), 1 if local_error is not None else 0], dtype=torch.int64)
    if size > 1:
        gathered = [torch.zeros(2, dtype=torch.int64, device=device) for _ in range(size)]
        dist.all_gather(gathered, mine.to(device), group=group)
        table = [g.cpu() for g in gathered]
    else:
        table = [mine]
    if local_error is not None:
        raise local_error
    failed = [r for r, row in enumerate(table) if int(row[1]) != 0]
    if failed:
        raise ValueError(
            f"data-parallel construction failed on group rank(s) {failed}; see the error on those ranks"
        )
    differ = [r for r, row in enumerate(table) if int(row[0]) != int(table[0][0])]
    if differ:
        raise ValueError(
            f"the model on group rank(s) {differ} differs from group rank 0 in parameter/buffer names, "
            "shapes or dtypes; every rank must build the same model"
        )
