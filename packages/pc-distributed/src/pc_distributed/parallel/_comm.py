"""The collectives DataParallel and DASO issue on a process group: the group, state broadcast, replica checks.

The data-parallel classes talk to ``torch.distributed`` through these functions. Only public torch APIs are
used (ranks are translated with ``dist.get_global_rank``, tensors flattened with ``torch.cat`` rather than the
private ``torch._utils`` helpers); anything private or version-specific belongs in
:mod:`pc_distributed._torch_dist`, the package's one torch-facing module.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "CommLike",
    "broadcast_tensors",
    "check_agreement",
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


def _digest(text: str) -> int:
    """A process-independent 62-bit hash of ``text`` (Python's ``hash`` of a str differs per process)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 62) - 1)


def _signature_hash(module: nn.Module) -> int:
    """A process-independent hash of the names, shapes and dtypes of a module's parameters and buffers."""
    parts = [f"p:{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}" for n, p in module.named_parameters()]
    parts += [f"b:{n}:{tuple(b.shape)}:{b.dtype}" for n, b in module.named_buffers()]
    return _digest("\n".join(parts))


def _encode(value: object) -> int:
    """``value`` as one int64: a bool or int as itself, a float by its bits, anything else by a repr hash.

    The same value gives the same code in every process, so equal codes mean equal settings.
    """
    if isinstance(value, (bool, int)) and -(1 << 63) <= int(value) < (1 << 63):
        return int(value)
    if isinstance(value, float):
        return int(struct.unpack("<q", struct.pack("<d", value))[0])
    return _digest(f"{type(value).__qualname__}:{value!r}")


def _decode(code: int, like: object) -> object:
    """The value another rank encoded as ``code``, read as the type of this rank's ``like`` (None: a hash)."""
    if isinstance(like, bool):
        return bool(code)
    if isinstance(like, int) and -(1 << 63) <= like < (1 << 63):
        return code
    if isinstance(like, float):
        return float(struct.unpack("<d", struct.pack("<q", code))[0])
    return None


def _gather_rows(row: Sequence[int], group: dist.ProcessGroup, device: torch.device) -> list[list[int]]:
    """Every group rank's ``row`` (same length on every rank), indexed by group rank: one all_gather."""
    mine = torch.tensor(list(row), dtype=torch.int64)
    size = group_size(group)
    if size == 1:
        return [mine.tolist()]
    gathered = [torch.zeros(len(row), dtype=torch.int64, device=device) for _ in range(size)]
    dist.all_gather(gathered, mine.to(device), group=group)
    return [g.cpu().tolist() for g in gathered]


def _disagreement(what: str, settings: Mapping[str, object], rows: Sequence[Sequence[int]]) -> str | None:
    """The message naming the first setting whose codes differ across ``rows`` (None if all agree)."""
    for column, (name, value) in enumerate(settings.items()):
        codes = [row[column] for row in rows]
        if len(set(codes)) == 1:
            continue
        if _decode(codes[0], value) is None:
            differ = [r for r, code in enumerate(codes) if code != codes[0]]
            found = f"differs on group rank(s) {differ} from group rank 0"
        else:
            found = f"differs across ranks: {[_decode(code, value) for code in codes]} by group rank"
        return f"{what}: {name} {found}; it must be the same on every rank"
    return None


def check_agreement(
    settings: Mapping[str, object], group: dist.ProcessGroup, device: torch.device, what: str
) -> None:
    """Check collectively that every rank holds the same ``settings``; else a ``ValueError`` on every rank.

    The settings are what decides which collectives a rank issues and what each of them carries (a schedule,
    a chunk size, a dtype, a bucket plan). One all_gather of one int64 per setting: bools, ints and floats
    travel as themselves (the error shows every rank's value), anything else as a hash of its ``repr``.

    Args:
        settings: Name -> value, the same names in the same order on every rank.
        group: The process group.
        device: The device the group's backend communicates on.
        what: Who checks (the start of the error message).

    Raises:
        ValueError: On every rank, naming the first setting that differs.
    """
    rows = _gather_rows([_encode(v) for v in settings.values()], group, device)
    message = _disagreement(what, settings, rows)
    if message is not None:
        raise ValueError(message)


def check_replicas(
    module: nn.Module,
    group: dist.ProcessGroup,
    device: torch.device,
    local_error: Exception | None = None,
    settings: Mapping[str, object] | None = None,
    what: str = "DataParallel",
) -> None:
    """Check collectively that every rank holds the same model structure and passed its local checks.

    Every member exchanges a hash of its parameter and buffer names/shapes/dtypes, a flag saying whether
    its own argument checks failed, and its ``settings`` (see :func:`check_agreement`), in one all_gather. All
    ranks therefore raise together (instead of one raising and the others hanging in the next collective, or
    aborting in it when the tensors they send differ in size).

    Args:
        module: The local replica.
        group: The process group.
        device: The device the group's backend communicates on.
        local_error: The error this rank found in its own arguments, if any; it is raised on this rank.
        settings: Name -> value of what else must agree (a mode, a bucket plan), the same names on every rank.
        what: Who checks (the start of a settings error).

    Raises:
        Exception: ``local_error`` on the rank that found it.
        ValueError: On the other ranks when some rank failed its checks, and on every rank when the models
            or the settings differ.
    """
    settings = settings or {}
    row = [_signature_hash(module), 1 if local_error is not None else 0, *map(_encode, settings.values())]
    table = _gather_rows(row, group, device)
    if local_error is not None:
        raise local_error
    failed = [r for r, got in enumerate(table) if int(got[1]) != 0]
    if failed:
        raise ValueError(
            f"data-parallel construction failed on group rank(s) {failed}; see the error on those ranks"
        )
    differ = [r for r, got in enumerate(table) if int(got[0]) != int(table[0][0])]
    if differ:
        raise ValueError(
            f"the model on group rank(s) {differ} differs from group rank 0 in parameter/buffer names, "
            "shapes or dtypes; every rank must build the same model"
        )
    message = _disagreement(what, settings, [got[2:] for got in table])
    if message is not None:
        raise ValueError(message)
