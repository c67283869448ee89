"""The two autograd nodes of a training replica's batch norm, with hand-written backwards.

A replica's forward is ``x ─► _LocalStats ─► (mean_k, M2_k) ─► master ─► (scale, shift) ─► _Normalize ─► y``.
Written with composite torch ops, autograd recorded about a dozen full-size nodes per call (sub, square, sum,
addcmul and their broadcasting backwards: several times the CPU time of ``nn.BatchNorm2d``'s fused kernels).
These two functions keep the full-size work to the minimum:

- forward: one reduction for the mean, one subtraction (``centered``, saved once and shared by both nodes),
  one reduction of the squares, one fused per-channel affine pass for ``y``;
- backward: ``_Normalize`` reduces ``sum(g)`` and ``sum(g * centered)`` (the gradients of ``shift`` and
  ``scale``) and hands ``g`` itself over; ``_LocalStats``, which autograd runs after every node between
  them (they are downstream of it), then writes the whole
  ``dx = g * scale + 2 * g_M2 * centered + g_mean / n`` into one new tensor. No full-size gradient is
  allocated twice, and autograd has no full-size sum to do.

Why it is exact: ``y = centered * scale + shift`` with ``shift = (mean_k - mean) * scale + bias`` equals
``(x - mean) * scale + bias``, so ``dy/dx = scale`` directly, and ``x``'s only other influence is through the
statistics ``(mean_k, M2_k)``: ``_Normalize`` treats ``centered`` (and the ``mean_k`` in ``shift``) as
constants and ``_LocalStats`` carries the statistics' gradient: ``d M2_k / dx = 2 * centered`` (the
``- 2 * sum(centered) / n`` term is zero) and ``d mean_k / dx = 1 / n``.

The hand-over: ``_Normalize``'s backward stores ``(g, scale)`` in a :class:`_Handoff` shared with the
``_LocalStats`` node of the same call and returns no gradient for ``x``; ``_LocalStats``'s backward takes it
(and clears it). When ``_LocalStats``'s backward runs without a hand-over (its statistics reached the loss
another way), it returns the statistics' part alone. A ``_Normalize`` backward whose ``x`` gradient is not
taken (``torch.autograd.grad`` of the weights only) leaves a hand-over that the next one replaces.

Both backwards are ``once_differentiable``: a double backward through a training replica raises.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

__all__ = ["channel_affine", "local_stats", "normalize"]


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _channel_shape(x: torch.Tensor) -> list[int]:
    return [1, x.size(1)] + [1] * (x.dim() - 2)


def channel_affine(t: torch.Tensor, factor: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``t * factor + offset`` per channel, in one fused pass (a new tensor).

    This is torch's eval-mode batch norm with mean 0 and ``var + eps == 1`` exactly, so its scale
    ``1 / sqrt(var + eps)`` is exactly 1: one read and one write, where a product and an in-place add take two
    of each, and ``addcmul`` with a broadcast ``self`` is slower still. ``eps`` is half the dtype's machine
    epsilon (a power of two) and ``var`` is ``1 - eps``; both are exact in the dtype and in any wider one, so
    the sum is exactly 1 however the kernel accumulates. ``eps`` must be positive: some torch releases reject
    ``eps=0``.
    """
    channels = t.size(1)
    eps = torch.finfo(t.dtype).eps / 2
    stats = t.new_zeros(2, channels)
    stats[1] = 1.0 - eps
    return torch.nn.functional.batch_norm(t, stats[0], stats[1], factor, offset, False, 0.0, eps)


class _Handoff:
    """One call's link between the ``_Normalize`` and ``_LocalStats`` backwards: ``(grad, scale)`` or None."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None


class _LocalStats(torch.autograd.Function):
    """``x -> (mean, M2, centered)``: per-channel mean, sum of squared deviations, and ``x - mean``."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, handoff: _Handoff
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dims = _reduce_dims(x)
        mean = x.mean(dims, keepdim=True)
        centered = x - mean
        m2 = centered.square().sum(dims)
        ctx.save_for_backward(centered)
        ctx.count = x.numel() // x.size(1)
        ctx.handoff = handoff
        ctx.mark_non_differentiable(centered)
        ctx.set_materialize_grads(False)  # no full-size zeros for ``centered``'s (absent) gradient
        return mean.reshape(x.size(1)), m2, centered

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, g_mean: torch.Tensor | None, g_m2: torch.Tensor | None, _g_centered: Any
    ) -> tuple[torch.Tensor | None, None]:
        (centered,) = ctx.saved_tensors
        handoff: _Handoff = ctx.handoff
        pending, handoff.pending = handoff.pending, None
        shape = _channel_shape(centered)
        if g_mean is None and g_m2 is None and pending is None:
            return None, None
        factor = 2 * g_m2 if g_m2 is not None else centered.new_zeros(centered.size(1))
        offset = g_mean / ctx.count if g_mean is not None else centered.new_zeros(centered.size(1))
        dx = channel_affine(centered, factor.to(centered.dtype), offset.to(centered.dtype))
        if pending is not None:
            grad, scale = pending
            dx.addcmul_(grad, scale.reshape(shape))
        return dx, None


class _Normalize(torch.autograd.Function):
    """``(x, centered, scale, shift) -> centered * scale + shift``, differentiable in ``x``, scale, shift."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        centered: torch.Tensor,
        scale: torch.Tensor,
        shift: torch.Tensor,
        handoff: _Handoff,
    ) -> torch.Tensor:
        ctx.save_for_backward(centered, scale)
        ctx.handoff = handoff
        return channel_affine(centered, scale.to(centered.dtype), shift.to(centered.dtype))

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        centered, scale = ctx.saved_tensors
        dims = _reduce_dims(centered)
        g_x = None
        if ctx.needs_input_grad[0]:
            # dx = grad * scale is written by _LocalStats's backward, together with the statistics' part.
            ctx.handoff.pending = (grad, scale.detach())
        g_scale = (grad * centered).sum(dims) if ctx.needs_input_grad[2] else None
        g_shift = grad.sum(dims) if ctx.needs_input_grad[3] else None
        return g_x, None, g_scale, g_shift, None


def local_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, _Handoff]:
    """Per-channel ``(mean, M2)`` of ``x`` (differentiable), ``x - mean`` (constant) and the call's hand-over.

    Args:
        x: A tensor of shape ``(N, C, ...)`` with at least one value per channel, in any memory format.

    Returns:
        ``(mean, M2, centered, handoff)``: two ``(C,)`` tensors, one of ``x``'s shape, and the object to pass
        to :func:`normalize`.
    """
    handoff = _Handoff()
    mean, m2, centered = _LocalStats.apply(x, handoff)  # type: ignore[no-untyped-call]
    return mean, m2, centered, handoff


def normalize(
    x: torch.Tensor, centered: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, handoff: _Handoff
) -> torch.Tensor:
    """``centered * scale + shift`` per channel; ``x`` gets the gradient ``grad * scale`` (via ``handoff``).

    Args:
        x: The replica's input (only its autograd identity is used; ``centered`` is ``x - mean_k``).
        centered: ``x`` minus its per-channel mean, from :func:`local_stats`.
        scale: ``(C,)`` factor, ``inv_std * weight``.
        shift: ``(C,)`` offset, ``(mean_k - mean) * scale + bias``.
        handoff: The hand-over returned by :func:`local_stats` for the same ``x``.

    Returns:
        The normalized tensor, of ``centered``'s shape.
    """
    out: torch.Tensor = _Normalize.apply(x, centered, scale, shift, handoff)  # type: ignore[no-untyped-call]
    return out
