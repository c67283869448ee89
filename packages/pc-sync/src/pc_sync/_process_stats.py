"""Batch-norm statistics of a batch split across the processes of a ``torch.distributed`` group.

One collective in forward, one in backward, public ``torch.distributed`` calls only (gloo on CPU tensors,
NCCL on CUDA tensors, any backend with ``all_gather`` and ``all_reduce``)::

    forward:  (n_p, mean_p, M2_p) ──all_gather──► every rank: Chan combine in rank order ──► (mean, M2, N)
    backward: (dL_p/dmean, dL_p/dM2) ──sum over the ranks──► (dL/dmean, dL/dM2) ──► this rank's (mean_p, M2_p)

The backward sum is an ``all_gather`` summed in rank order for CPU tensors and an ``all_reduce`` for others:
gloo's ring ``all_gather`` of a small packet takes one round between the ranks where its ``all_reduce`` takes
two, and each round costs the ranks' threads CPU that a machine with few cores has to take from the compute;
NCCL's ``all_reduce`` is one kernel.

Forward gathers each rank's count, mean and sum of squared deviations (M2) rather than summing sums and sums
of squares: Chan's combination keeps the precision of data far from zero, and every rank combines the same
table in the same order, so every rank holds bitwise the same statistics (and running statistics). The wire
dtype is float64, so counts stay exact and the combination loses nothing to the statistics' dtype.

Backward sums over the ranks the gradients that each rank's outputs sent to the global ``(mean, M2)`` --
equivalent to summing ``sum(grad)`` and ``sum(grad * xhat)`` -- and maps the totals back to this rank's
statistics: ``d mean / d mean_p = n_p / N``, ``d M2 / d M2_p = 1`` and ``d M2 / d mean_p = 2 n_p (mean_p -
mean)`` (the terms through ``mean`` cancel because ``sum_q n_q (mean_q - mean) == 0``).

Every rank must take part in both collectives, also with an empty batch (count 0). Whether a rank records the
backward node travels with the forward table, so a rank that would skip the backward collective is an error
on every rank in forward instead of a hang in backward. The backward packet also carries the call's ordinal
(its place among this group's recording calls, the same on every rank): a backward that met another layer
call on some peer (autograd ran independent branches in different orders) raises instead of passing mixed
gradients on silently: at once on CPU, at the group's next forward exchange on accelerators (whose counts that
exchange reads anyway), so backward adds no host synchronization there.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "exchange_gradients",
    "exchange_statistics",
    "group_size",
    "next_ordinal",
    "reduce_across_processes",
]

_WIRE = torch.float64
_HEADER = 2  # count, records-backward flag
_ORDINAL_WRAP = 2**31  # call ordinals stay exact in float64 sums over any group size
# Recording calls per process group in this process: the forward gathers run in the same order on every rank,
# so the n-th call is the same layer call on every rank; backward checks it met its peers' n-th call.
_recorded_calls: dict[int, int] = {}
# Summed ordinals of backward exchanges on accelerators, checked at the group's next forward exchange.
_unchecked: dict[int, list[tuple[torch.Tensor, int]]] = {}


def group_size(group: Any) -> int:
    """The number of processes in ``group`` (``None``: the default group); 1 without ``torch.distributed``.

    Raises:
        ValueError: If this process is not a member of ``group``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    size = dist.get_world_size(group)
    if size < 1:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of process_group {group!r}"
        )
    return size


def _peers(group: Any) -> tuple[int, list[int]]:
    """This process's rank in ``group`` and the other members' ranks in it."""
    rank = dist.get_rank(group)
    return rank, [r for r in range(dist.get_world_size(group)) if r != rank]


def _lost_peer(phase: str, group: Any, exc: BaseException) -> Exception:
    """A ``TimeoutError`` or ``ConnectionError`` naming the exchange, this rank and the peers it awaited."""
    rank, peers = _peers(group)
    text = str(exc)
    message = (
        f"SyncBatchNorm: the {phase} exchange of batch statistics failed on rank {rank} while waiting for "
        f"rank(s) {peers} of its process group: a peer raised, died, or did not call this layer the same "
        f"way ({type(exc).__name__}: {text})"
    )
    if "timeout" in text.lower() or "timed out" in text.lower():
        return TimeoutError(message)
    return ConnectionError(message)


def _all_gather(local: torch.Tensor, size: int, group: Any, phase: str = "forward") -> torch.Tensor:
    table = [torch.empty_like(local) for _ in range(size)]
    try:
        dist.all_gather(table, local, group=group)
    except RuntimeError as exc:
        raise _lost_peer(phase, group, exc) from exc
    return torch.stack(table)


def _all_reduce(packet: torch.Tensor, group: Any) -> None:
    try:
        dist.all_reduce(packet, op=dist.ReduceOp.SUM, group=group)
    except RuntimeError as exc:
        raise _lost_peer("backward", group, exc) from exc


def _check_same_call(summed: float, ordinal: int, group: Any) -> None:
    """Raise if a backward exchange summed different layer calls' gradients across the ranks."""
    expected = float(ordinal) * dist.get_world_size(group)
    if summed != expected:
        raise RuntimeError(
            f"SyncBatchNorm: rank {dist.get_rank(group)}'s backward exchange for its layer call #{ordinal} "
            "met other layer calls on its peers: the processes ran the synchronized layers' backward in "
            "different orders (independent branches whose order autograd does not fix), so those gradients "
            "were wrong. Make the forward the same on every rank, or join the branches in one layer"
        )


def _check_pending(group: Any) -> None:
    """The checks that backward left for later on devices where reading the result would wait for it."""
    for summed, ordinal in _unchecked.pop(id(group), []):
        _check_same_call(float(summed), ordinal, group)


def exchange_gradients(parts: list[torch.Tensor], ordinal: int, group: Any) -> torch.Tensor:
    """The sum over ``group`` of the concatenated per-channel gradient ``parts``: one collective.

    On CPU an ``all_gather`` summed in rank order (one gloo round; every rank gets bitwise the same sum),
    elsewhere an ``all_reduce``.

    The packet carries ``ordinal`` (the layer call's place among the group's recording calls) after the
    parts; the sum of the ordinals proves that every rank sent the same layer call's gradients (checked at
    once on CPU, at the group's next forward exchange on accelerators).

    Returns:
        The summed parts, concatenated, float64 (the wire dtype).
    """
    device = parts[0].device
    tag = torch.full((1,), float(ordinal), dtype=_WIRE, device=device)
    packet = torch.cat([*(p.reshape(-1).to(_WIRE) for p in parts), tag])
    if device.type == "cpu":
        packet = _all_gather(packet, group_size(group), group, "backward").sum(0)
    else:
        _all_reduce(packet, group)
    if device.type == "cpu":
        _check_same_call(float(packet[-1]), ordinal, group)
    else:  # read at the next forward exchange, which reads the gathered counts anyway: no extra sync here
        _unchecked.setdefault(id(group), []).append((packet[-1:], ordinal))
    return packet[:-1]


class _AcrossProcesses(torch.autograd.Function):
    """``(mean_p, M2_p) -> (mean, M2)``: the global statistics; backward all-reduces their gradient.

    The global values are computed (from the gathered table) before the call and passed in as constants; this
    node only gives them their gradient.
    """

    @staticmethod
    def forward(
        ctx: Any,
        mean_p: torch.Tensor,
        m2_p: torch.Tensor,
        mean: torch.Tensor,
        m2: torch.Tensor,
        count_p: int,
        total: int,
        group: Any,
        ordinal: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(mean_p.detach().to(_WIRE) - mean)
        ctx.count_p = count_p
        ctx.total = total
        ctx.group = group
        ctx.ordinal = ordinal
        return mean.to(mean_p.dtype), m2.to(m2_p.dtype)

    @staticmethod
    def backward(ctx: Any, g_mean: torch.Tensor, g_m2: torch.Tensor) -> tuple[Any, ...]:
        (diff,) = ctx.saved_tensors
        channels = g_mean.numel()
        summed = exchange_gradients([g_mean, g_m2], ctx.ordinal, ctx.group)
        total_mean, total_m2 = summed[:channels], summed[channels:]
        grad_mean_p = (ctx.count_p / ctx.total) * total_mean + (2 * ctx.count_p) * total_m2 * diff
        return grad_mean_p.to(g_mean.dtype), total_m2.to(g_m2.dtype), None, None, None, None, None, None


def exchange_statistics(
    mean_p: torch.Tensor, m2_p: torch.Tensor, count_p: int, records: bool, group: Any
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The whole batch's ``(mean, M2, N)`` from this process's ``(mean, M2, count)``: one ``all_gather``.

    Collective: every member of ``group`` must call it for the same layer, also with ``count_p == 0``.
    ``records`` says whether this rank will make the backward exchange of this call; every rank must agree.

    Returns:
        ``(mean, M2, N)``: two ``(C,)`` float64 tensors (the wire dtype) and the total count.

    Raises:
        ValueError: If the ranks disagree on ``records`` (the backward collective would hang), or the whole
            batch has no values.
        ConnectionError: If a peer failed or left during the exchange.
        TimeoutError: If a peer did not reach the exchange within the group's timeout.
    """
    size = group_size(group)
    channels = mean_p.numel()
    header = torch.tensor([float(count_p), float(records)], dtype=_WIRE, device=mean_p.device)
    local = torch.cat([header, mean_p.reshape(-1).to(_WIRE), m2_p.reshape(-1).to(_WIRE)])
    table = _all_gather(local, size, group)
    head = table[:, :_HEADER].cpu().tolist()
    _check_pending(group)
    counts = [int(c) for c, _ in head]
    flags = [bool(f) for _, f in head]
    total = sum(counts)
    if len(set(flags)) > 1:
        without = [r for r, f in enumerate(flags) if not f]
        raise ValueError(
            f"SyncBatchNorm: ranks {without} of the process group run this layer without autograd recording "
            "(no_grad, or an input that does not require grad) while the others record it; the backward "
            "exchange would wait forever. Run the same mode on every rank"
        )
    if total == 0:
        raise ValueError("SyncBatchNorm: the batch is empty on every rank of the process group")
    weights = table[:, 0:1] / total
    means = table[:, _HEADER : _HEADER + channels]
    mean = (weights * means).sum(0)
    m2 = table[:, _HEADER + channels :].sum(0) + (table[:, 0:1] * (means - mean).square()).sum(0)
    return mean, m2, total


def next_ordinal(group: Any) -> int:
    """The number of this recording layer call among ``group``'s, the same on every rank (see the module)."""
    key = id(group)
    ordinal = _recorded_calls.get(key, 0)
    _recorded_calls[key] = (ordinal + 1) % _ORDINAL_WRAP
    return ordinal


def reduce_across_processes(
    mean_p: torch.Tensor, m2_p: torch.Tensor, count_p: int, group: Any
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The statistics of the whole batch from this process's ``(mean, M2, count)``: one ``all_gather``.

    Collective: every member of ``group`` must call it for the same layer, also with ``count_p == 0``. With
    autograd recording, the returned tensors carry a backward that all-reduces their gradient once.

    Args:
        mean_p: ``(C,)`` per-channel mean of this process's batch (zeros if it is empty).
        m2_p: ``(C,)`` per-channel sum of squared deviations from ``mean_p``.
        count_p: Values per channel in this process's batch.
        group: The process group (``None``: the default group).

    Returns:
        ``(mean, M2, N)`` of the whole batch: two ``(C,)`` tensors in ``mean_p``'s dtype and the total count.

    Raises:
        ValueError: If the ranks disagree on recording autograd (the backward collective would hang), or the
            whole batch has no values.
        ConnectionError: If a peer failed or left during the exchange.
        TimeoutError: If a peer did not reach the exchange within the group's timeout.
    """
    records = torch.is_grad_enabled() and (mean_p.requires_grad or m2_p.requires_grad)
    mean, m2, total = exchange_statistics(mean_p.detach(), m2_p.detach(), count_p, records, group)
    if not records:
        return mean.to(mean_p.dtype), m2.to(m2_p.dtype), total
    out_mean, out_m2 = _AcrossProcesses.apply(  # type: ignore[no-untyped-call]
        mean_p, m2_p, mean, m2, count_p, total, group, next_ordinal(group)
    )
    return out_mean, out_m2, total
