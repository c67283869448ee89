"""Batch-norm statistics of a batch split across the processes of a ``torch.distributed`` group.

One collective in forward, one in backward, public ``torch.distributed`` calls only (gloo on CPU tensors,
NCCL on CUDA tensors, any backend with ``all_gather`` and ``all_reduce``); the packets and their checks are
``pc_sync._exchange``'s::

    forward:  (n_p, mean_p, M2_p) ──all_gather──► every rank: Chan combine in rank order ──► (mean, M2, N)
    backward: (dL_p/dmean, dL_p/dM2) ──sum over the ranks──► (dL/dmean, dL/dM2) ──► this rank's (mean_p, M2_p)

Forward gathers each rank's count, mean and sum of squared deviations (M2) rather than summing sums and sums
of squares: Chan's combination keeps the precision of data far from zero, and every rank combines the same
table in the same order, so every rank holds bitwise the same statistics (and running statistics). The wire
dtype is float64, so counts stay exact and the combination loses nothing to the statistics' dtype.

Backward turns the gradient that this process's outputs sent to the global ``(mean, M2)`` into the exchange's
weight-free sums (``pc_sync._exchange``): with ``y = (x - mean) * s + bias``, ``s = inv_std * weight`` and
``inv_std = (M2 / N + eps) ** -0.5``, ``dL_p/dmean = -s * sum_p(dy)`` and
``dL_p/dM2 = -s * inv_std**2 * sum_p(dy * (x - mean)) / (2 N)``; the sums over the ranks go back the same
way and onto this rank's statistics: ``d mean / d mean_p = n_p / N``, ``d M2 / d M2_p = 1`` and
``d M2 / d mean_p = 2 n_p (mean_p - mean)`` (the terms through ``mean`` cancel because
``sum_q n_q (mean_q - mean) == 0``). A channel whose weight is 0 sends zeros: its outputs do not depend on
the statistics.

Every rank must take part in both collectives, also with an empty batch (count 0). Whether a rank records the
backward node travels with the forward table, so a rank that would skip the backward collective is an error
on every rank in forward instead of a hang in backward.
"""

from __future__ import annotations

from typing import Any

import torch

from pc_sync._exchange import exchange_gradients, exchange_statistics_table

__all__ = ["combine_table", "exchange_statistics", "reduce_across_processes"]

_WIRE = torch.float64


def combine_table(
    counts: list[int], means: torch.Tensor, m2s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chan's combination of a gathered ``(count, mean, M2)`` table, in rank order: the global ``(mean, M2)``.

    Args:
        counts: Every rank's count (their sum must be positive).
        means: ``(R, C)`` float64 per-rank means.
        m2s: ``(R, C)`` float64 per-rank sums of squared deviations.
    """
    total = sum(counts)
    weights = torch.tensor(counts, dtype=_WIRE).to(means.device).unsqueeze(1)
    mean = (weights * means).sum(0) / total
    m2 = m2s.sum(0) + (weights * (means - mean).square()).sum(0)
    return mean, m2


def exchange_statistics(
    mean_p: torch.Tensor,
    m2_p: torch.Tensor,
    count_p: int,
    records: bool,
    group: Any,
    *,
    replicas: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, int, int | None]:
    """The whole batch's ``(mean, M2, N)`` from this process's ``(mean, M2, count)``: one ``all_gather``.

    Collective: every member of ``group`` must call it for the same layer, also with ``count_p == 0``.
    ``records`` says whether this rank will make the backward exchange of this call; every rank must agree.

    Returns:
        ``(mean, M2, N, ordinal)``: two ``(C,)`` float64 tensors, the total count, and the call's ordinal for
        its backward exchange (``None`` without recording).

    Raises:
        ValueError: If the ranks' calls differ (see ``pc_sync._exchange``), or the whole batch has no values.
        ConnectionError: If a peer failed or left during the exchange.
        TimeoutError: If a peer did not reach the exchange within the group's timeout.
    """
    table = exchange_statistics_table(
        mean_p, m2_p, count_p, records=records, replicas=replicas, dtype=dtype, group=group
    )
    total = sum(table.counts)
    if total == 0:
        raise ValueError("SyncBatchNorm: the batch is empty on every rank of the process group")
    mean, m2 = combine_table(table.counts, table.means, table.m2s)
    return mean, m2, total, table.ordinal


class _AcrossProcesses(torch.autograd.Function):
    """``(mean_p, M2_p) -> (mean, M2)``: the global statistics; backward sums their gradient over the ranks.

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
        dtype: torch.dtype,
        weight: torch.Tensor | None,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_std = torch.rsqrt(m2 / total + eps)
        scale = inv_std if weight is None else inv_std * weight.detach().to(_WIRE)
        ctx.save_for_backward(mean_p.detach().to(_WIRE) - mean, inv_std, scale)
        ctx.count_p = count_p
        ctx.total = total
        ctx.group = group
        ctx.ordinal = ordinal
        ctx.dtype = dtype
        return mean.to(mean_p.dtype), m2.to(m2_p.dtype)

    @staticmethod
    def backward(ctx: Any, g_mean: torch.Tensor, g_m2: torch.Tensor) -> tuple[Any, ...]:
        diff, inv_std, scale = ctx.saved_tensors
        total = ctx.total
        # dL_p/dmean = -s * sum(dy), dL_p/dM2 = -s * inv_std**2 * sum(dy * (x - mean)) / (2 N)
        zero = scale == 0
        safe = torch.where(zero, torch.ones_like(scale), scale)
        sum_dy = torch.where(zero, 0.0, -g_mean.to(_WIRE) / safe)
        sum_dy_xmu = torch.where(zero, 0.0, g_m2.to(_WIRE) * (-2.0 * total) / (safe * inv_std.square()))
        summed = exchange_gradients(sum_dy, sum_dy_xmu, ordinal=ctx.ordinal, dtype=ctx.dtype, group=ctx.group)
        total_mean = -scale * summed[0]
        total_m2 = scale * inv_std.square() * summed[1] * (-0.5 / total)
        grad_mean_p = (ctx.count_p / total) * total_mean + (2 * ctx.count_p) * total_m2 * diff
        rest = (None,) * 9
        return grad_mean_p.to(g_mean.dtype), total_m2.to(g_m2.dtype), *rest


def reduce_across_processes(
    mean_p: torch.Tensor,
    m2_p: torch.Tensor,
    count_p: int,
    group: Any,
    *,
    replicas: int,
    dtype: torch.dtype,
    weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The statistics of the whole batch from this process's ``(mean, M2, count)``: one ``all_gather``.

    Collective: every member of ``group`` must call it for the same layer, also with ``count_p == 0``. With
    autograd recording, the returned tensors carry a backward that sums their gradient over the ranks once.

    Args:
        mean_p: ``(C,)`` per-channel mean of this process's batch (zeros if it is empty).
        m2_p: ``(C,)`` per-channel sum of squared deviations from ``mean_p``.
        count_p: Values per channel in this process's batch.
        group: The process group (``None``: the default group).
        replicas: The replicas this process ran the layer on, for error messages.
        dtype: The layer's input dtype on this rank.
        weight: The layer's weight (``None`` without affine): backward turns the statistics' gradient into
            the exchange's sums with it.
        eps: The layer's ``eps``.

    Returns:
        ``(mean, M2, N)`` of the whole batch: two ``(C,)`` tensors in ``mean_p``'s dtype and the total count.

    Raises:
        ValueError: If the ranks' calls differ, or the whole batch has no values.
        ConnectionError: If a peer failed or left during the exchange.
        TimeoutError: If a peer did not reach the exchange within the group's timeout.
    """
    records = torch.is_grad_enabled() and (mean_p.requires_grad or m2_p.requires_grad)
    mean, m2, total, ordinal = exchange_statistics(
        mean_p.detach(), m2_p.detach(), count_p, records, group, replicas=replicas, dtype=dtype
    )
    if ordinal is None:
        return mean.to(mean_p.dtype), m2.to(m2_p.dtype), total
    out_mean, out_m2 = _AcrossProcesses.apply(  # type: ignore[no-untyped-call]
        mean_p, m2_p, mean, m2, count_p, total, group, ordinal, dtype, weight, eps
    )
    return out_mean, out_m2, total
