"""A training batch norm over the processes of a group, for a process without replicas: one autograd node.

This is :class:`~pc_sync.SyncBatchNorm`'s path under DDP (one replica per process). Its full-size work is
torch's fused kernels plus the few passes that the exchange forces between a reduction and its use::

    forward:  mean_p = mean(x); c = x - mean_p; M2_p = sum(c * c)            (no graph: constants)
              ──all_gather (count, mean_p, M2_p)──► (mean, var) of the whole batch  (pc_sync._process_stats)
              y = (c - (mean - mean_p)) * inv_std * weight + bias              (torch's eval-mode batch norm)
    backward: G_p = sum(g), S_p = sum(g * (x - mean))                          (this process's part)
              ──sum over the ranks of (G_p, S_p)──► (G, S) of the whole batch
              dx = inv_std * weight * (g - G / N - (x - mean) * inv_std**2 * S / N)

Why not the replicas' two nodes (``pc_sync._autograd``) with a node for the exchange: their small per-channel
ops (scale, shift, inv_std, the casts) each record an autograd node, and each node costs more CPU than the
arithmetic of a few dozen channels. Here the module computes the statistics before the call and passes them
in as constants, and this one node gives ``x``, ``weight`` and ``bias`` their whole gradient.

Why ``c = x - mean_p`` is kept rather than ``x``: it is the same size as the input that torch's own batch norm
saves, and normalizing ``c`` by the (small) difference of the means keeps the precision of data far from zero
in the output and in ``S_p``, where ``x * inv_std - mean * inv_std`` would cancel.

The gradient: with ``xhat = (x - mean) * inv_std`` and ``y = xhat * w + b``, the full-batch derivative is
``dx = w * inv_std * (g - G / N - (x - mean) * inv_std**2 * S / N)`` where ``G = sum(g)`` and
``S = sum(g * (x - mean))`` run over the whole batch (every process's share): each process computes its part
with the common ``mean``, the exchange (``pc_sync._exchange``, the same sums on every path) adds them, and
``dx`` is ``A * g + B * c + C`` per channel. The parameter gradients are this process's ``inv_std * S_p`` and
``G_p``: DDP (or the caller) sums them over the processes as for any parameter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from pc_sync._autograd import channel_affine
from pc_sync._exchange import exchange_gradients

__all__ = ["batch_norm_across", "local_moments"]


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def local_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Per-channel mean and sum of squared deviations of ``x``, and ``x`` centered on its mean (no graph).

    Two passes (the mean, then the squares of the centered values) are as accurate as Welford's and, on CPU,
    several times faster than ``torch.var_mean`` or the statistics pass of a training-mode batch norm over the
    non-contiguous ``(0, 2, ...)`` dims.

    Args:
        x: A tensor ``(N, C, ...)`` with ``C >= 1``, in any memory format; ``N`` may be 0.

    Returns:
        ``(mean, M2, centered, count)``: two ``(C,)`` tensors in ``x``'s dtype (zeros for an empty ``x``),
        ``x - mean`` in ``x``'s shape and memory format, and the number of values per channel.
    """
    channels = x.size(1)
    count = x.numel() // channels
    with torch.no_grad():
        if count == 0:
            zeros = x.new_zeros(channels)
            return zeros, zeros, x.detach(), 0
        dims = _reduce_dims(x)
        mean = x.mean(dims, keepdim=True)
        centered = x.detach() - mean
        m2 = centered.square().sum(dims)
    return mean.reshape(channels), m2, centered, count


class _ProcessBatchNorm(torch.autograd.Function):
    """``(x, weight, bias) -> y``: the normalization with given global statistics; backward exchanges once."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        centered: torch.Tensor,
        shift: torch.Tensor,
        var: torch.Tensor,
        eps: float,
        total: int,
        group: Any,
        ordinal: int | None,
        input_dtype: torch.dtype,
    ) -> torch.Tensor:
        dtype = centered.dtype
        w = weight if weight is None or weight.dtype == dtype else weight.to(dtype)
        b = bias if bias is None or bias.dtype == dtype else bias.to(dtype)
        out = F.batch_norm(centered, shift, var, w, b, False, 0.0, eps)
        ctx.save_for_backward(centered, shift, var, w)
        ctx.eps = eps
        ctx.total = total
        ctx.group = group
        ctx.ordinal = ordinal
        ctx.dtype = input_dtype
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor | None) -> tuple[Any, ...]:
        centered, shift, var, w = ctx.saved_tensors
        inv_std = torch.rsqrt(var + ctx.eps)
        needs_x, needs_w, needs_b = ctx.needs_input_grad[:3]
        rest = (None,) * 8
        if g is None:
            # No gradient reached the output: this process's share of the exchange is zero, but it still
            # takes part (its peers wait for it).
            g = torch.zeros_like(centered)
        dims = _reduce_dims(centered)
        sum_g = g.sum(dims)
        # sum(g * (x - mean)), with x - mean == centered - shift
        sum_gxmu = torch.addcmul((g * centered).sum(dims), shift, sum_g, value=-1.0)
        grad_w = sum_gxmu * inv_std if needs_w else None
        grad_b = sum_g if needs_b else None
        if not needs_x:
            return None, grad_w, grad_b, *rest
        summed = exchange_gradients(sum_g, sum_gxmu, ordinal=ctx.ordinal, dtype=ctx.dtype, group=ctx.group)
        if summed.dtype != g.dtype:
            summed = summed.to(g.dtype)
        scale = inv_std if w is None else inv_std * w
        k = scale * (-1.0 / ctx.total)
        # dx = A * g + B * centered + C with A = scale, B = -scale * inv_std**2 * S / N and
        # C = -scale * G / N - B * shift (centered - shift is x - mean), G and S the whole batch's sums
        factor = k * inv_std.square() * summed[1]
        offset = torch.addcmul(k * summed[0], factor, shift, value=-1.0)
        dx = channel_affine(centered, factor, offset)
        dx.addcmul_(g, scale.reshape([1, scale.numel()] + [1] * (g.dim() - 2)))
        return dx, grad_w, grad_b, *rest


def batch_norm_across(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    centered: torch.Tensor,
    shift: torch.Tensor,
    var: torch.Tensor,
    eps: float,
    total: int,
    group: Any,
    ordinal: int | None,
    input_dtype: torch.dtype,
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` with the whole batch's ``mean`` and ``var``.

    Differentiable in ``x``, ``weight`` and ``bias``; the ``x`` gradient is that of the batch norm of the
    whole batch, whose backward makes one exchange over ``group`` (every process of the group must run
    it; ``ordinal`` is this call's number from its forward exchange, ``None`` when ``x`` does not require
    grad).

    Args:
        x: This process's input (only its autograd identity is used: ``centered`` holds its values).
        weight: ``(C,)`` or None.
        bias: ``(C,)`` or None.
        centered: ``x - mean_p`` from :func:`local_moments`.
        shift: ``(C,)`` ``mean - mean_p`` in ``centered``'s dtype.
        var: ``(C,)`` the whole batch's biased variance in ``centered``'s dtype.
        eps: Added to ``var``.
        total: The whole batch's values per channel.
        group: The process group.
        ordinal: The call's number for the backward exchange.
        input_dtype: The layer's input dtype (the backward exchange's header names it).

    Returns:
        The normalized tensor, of ``centered``'s shape, dtype and memory format.
    """
    out: torch.Tensor = _ProcessBatchNorm.apply(  # type: ignore[no-untyped-call]
        x, weight, bias, centered, shift, var, eps, total, group, ordinal, input_dtype
    )
    return out
