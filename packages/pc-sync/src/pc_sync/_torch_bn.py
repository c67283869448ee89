"""torch's fused batch-norm kernels, behind a capability check, and pure-torch stand-ins of the same five.

``torch.nn.SyncBatchNorm`` is built on five ATen operators that exist for CUDA (and ROCm) only::

    batch_norm_stats(x, eps)                                   -> (mean, invstd)         per channel
    batch_norm_gather_stats_with_counts(x, means, invstds,     -> (mean, invstd)         of R parts; updates
        running_mean, running_var, momentum, eps, counts)                                the running stats
    batch_norm_elemt(x, weight, bias, mean, invstd, eps)       -> (x - mean) * invstd * weight + bias
    batch_norm_backward_reduce(dy, x, mean, invstd, weight,    -> (sum dy, sum dy * (x - mean),
        input_g, weight_g, bias_g)                                 grad_weight, grad_bias)
    batch_norm_backward_elemt(dy, x, mean, invstd, weight,     -> dx of the whole batch's batch norm
        sum_dy, sum_dy_xmu, count)

pc-sync's CUDA path (``pc_sync._fused``) drives them through a :class:`BatchNormKernels` object chosen per
device by :func:`kernels_for`: :data:`TORCH_KERNELS` (the operators themselves) for CUDA tensors when this
torch has all five, ``None`` (the composite float64 path) otherwise. :data:`REFERENCE_KERNELS` computes the
same results with ordinary torch ops on any device, with the operators' dtype rules and refusals, so the CUDA
path's orchestration runs -- and is tested -- on CPU: a module whose ``_bn_kernels`` attribute holds a
kernel set uses it on every device.

The stand-ins' contract is the CUDA kernels' (``aten/src/ATen/native/cuda/Normalization.cu*``):

- statistics, ``sum_dy`` and ``sum_dy_xmu`` are in the accumulation dtype (float32 for fp16/bf16 inputs, the
  input's dtype otherwise); weights are in the input's dtype or the accumulation dtype;
- ``batch_norm_gather_stats_with_counts`` reads ``means``/``invstds`` in the accumulation dtype of the
  running statistics' dtype (the input's without them) and ``counts`` in that dtype itself, combines the
  parts in order (a part's variance is recovered as ``invstd**-2 - eps``) and updates the running statistics
  in place with the unbiased variance;
- ``batch_norm_backward_elemt``'s ``count`` is an int32 tensor whose sum is the whole batch's count.

Two refusals are stricter than CUDA, where the result would be undefined rather than an error: an empty input
to ``batch_norm_stats`` / ``batch_norm_backward_reduce`` / ``batch_norm_backward_elemt``, and a part with a
count below 1 in the gather (the kernel's combination gives NaN when the first part is empty). The
orchestration never asks for either; the stand-ins make sure of it.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

__all__ = [
    "FUSED_OPS",
    "REFERENCE_KERNELS",
    "TORCH_KERNELS",
    "BatchNormKernels",
    "ReferenceKernels",
    "TorchKernels",
    "accumulation_dtype",
    "fused_kernels_available",
    "kernels_for",
]

FUSED_OPS = (
    "batch_norm_stats",
    "batch_norm_gather_stats_with_counts",
    "batch_norm_elemt",
    "batch_norm_backward_reduce",
    "batch_norm_backward_elemt",
)
"""The torch operators the CUDA path needs, all of which :func:`fused_kernels_available` checks."""

_LOW = (torch.float16, torch.bfloat16)
_Stats = tuple[torch.Tensor, torch.Tensor]
_Reduced = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels compute and return statistics in for inputs of ``dtype``."""
    return torch.float32 if dtype in _LOW else dtype


class BatchNormKernels(Protocol):
    """The five batch-norm kernels, with torch's signatures (see the module)."""

    name: str

    def batch_norm_stats(self, input: torch.Tensor, eps: float) -> _Stats:
        """Per-channel mean and ``1 / sqrt(biased var + eps)`` of ``input`` ``(N, C, ...)``."""
        ...

    def batch_norm_gather_stats_with_counts(
        self,
        input: torch.Tensor,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        momentum: float,
        eps: float,
        counts: torch.Tensor,
    ) -> _Stats:
        """The combined mean and invstd of ``R`` parts ``(R, C)``; updates the running statistics."""
        ...

    def batch_norm_elemt(
        self,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """``(input - mean) * invstd * weight + bias`` per channel, in ``input``'s dtype and layout."""
        ...

    def batch_norm_backward_reduce(
        self,
        grad_out: torch.Tensor,
        input: torch.Tensor,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        weight: torch.Tensor | None,
        input_g: bool,
        weight_g: bool,
        bias_g: bool,
    ) -> _Reduced:
        """``(sum dy, sum dy * (x - mean), grad_weight, grad_bias)``, each only where asked for."""
        ...

    def batch_norm_backward_elemt(
        self,
        grad_out: torch.Tensor,
        input: torch.Tensor,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        weight: torch.Tensor | None,
        sum_dy: torch.Tensor,
        sum_dy_xmu: torch.Tensor,
        count: torch.Tensor,
    ) -> torch.Tensor:
        """The input gradient of the batch norm of the whole batch (``sum(count)`` values per channel)."""
        ...


class TorchKernels:
    """The operators themselves (CUDA and ROCm tensors only)."""

    name = "torch"

    def batch_norm_stats(self, input: torch.Tensor, eps: float) -> _Stats:
        """See :class:`BatchNormKernels`."""
        mean, invstd = torch.batch_norm_stats(input, eps)
        return mean, invstd

    def batch_norm_gather_stats_with_counts(
        self,
        input: torch.Tensor,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        momentum: float,
        eps: float,
        counts: torch.Tensor,
    ) -> _Stats:
        """See :class:`BatchNormKernels`."""
        out_mean, out_invstd = torch.batch_norm_gather_stats_with_counts(
            input, mean, invstd, running_mean, running_var, momentum, eps, counts
        )
        return out_mean, out_invstd

    def batch_norm_elemt(
        self,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """See :class:`BatchNormKernels`."""
        return torch.batch_norm_elemt(input, weight, bias, mean, invstd, eps)

    def batch_norm_backward_reduce(
        self,
        grad_out: torch.Tensor,
        input: torch.Tensor,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        weight: torch.Tensor | None,
        input_g: bool,
        weight_g: bool,
        bias_g: bool,
    ) -> _Reduced:
        """See :class:`BatchNormKernels`."""
        sum_dy, sum_dy_xmu, grad_weight, grad_bias = torch.batch_norm_backward_reduce(
            grad_out, input, mean, invstd, weight, input_g, weight_g, bias_g
        )
        return (
            sum_dy if input_g else None,
            sum_dy_xmu if input_g else None,
            grad_weight if weight_g else None,
            grad_bias if bias_g else None,
        )

    def batch_norm_backward_elemt(
        self,
        grad_out: torch.Tensor,
        input: torch.Tensor,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        weight: torch.Tensor | None,
        sum_dy: torch.Tensor,
        sum_dy_xmu: torch.Tensor,
        count: torch.Tensor,
    ) -> torch.Tensor:
        """See :class:`BatchNormKernels`."""
        return torch.batch_norm_backward_elemt(
            grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count
        )


def _channel(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A ``(C,)`` tensor shaped to broadcast over ``like`` ``(N, C, ...)``."""
    return t.reshape([1, t.numel()] + [1] * (like.dim() - 2))


def _dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _expect(t: torch.Tensor | None, dtype: torch.dtype, what: str) -> None:
    """The CUDA kernels' accessor check: a tensor argument of another dtype is refused."""
    if t is not None and t.dtype != dtype:
        raise RuntimeError(f"Expected {what} to have type {dtype} but got {t.dtype}")


def _nonempty(t: torch.Tensor, op: str) -> None:
    if t.numel() == 0:
        raise ValueError(f"{op}: an empty input (its result is undefined on CUDA; the caller must skip it)")


def _stat_types(input: torch.Tensor, weight: torch.Tensor | None) -> tuple[torch.dtype, torch.dtype]:
    """The (weight dtype, statistics dtype) that the elementwise kernels expect.

    A weight of the input's dtype, or of the accumulation dtype (the "mixed" kernels); statistics in the
    accumulation dtype either way.
    """
    acc = accumulation_dtype(input.dtype)
    mixed = weight is not None and weight.dtype != input.dtype
    return (acc if mixed else input.dtype), acc


class ReferenceKernels:
    """Pure-torch stand-ins of the five kernels: the same signatures, results, dtypes and refusals."""

    name = "reference"

    def batch_norm_stats(self, input: torch.Tensor, eps: float) -> _Stats:
        """See :class:`BatchNormKernels`."""
        _nonempty(input, "batch_norm_stats")
        acc = accumulation_dtype(input.dtype)
        var, mean = torch.var_mean(input.to(acc), dim=_dims(input), correction=0)
        if eps == 0:  # torch's InvStd: 0 for a zero variance with a zero eps
            invstd = torch.where(var == 0, torch.zeros_like(var), var.rsqrt())
        else:
            invstd = torch.rsqrt(var + eps)
        return mean, invstd

    def batch_norm_gather_stats_with_counts(
        self,
        input: torch.Tensor,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        momentum: float,
        eps: float,
        counts: torch.Tensor,
    ) -> _Stats:
        """See :class:`BatchNormKernels`."""
        if mean.dim() != 2:
            raise RuntimeError(
                "batch_norm_gather_stats_with_counts: expected mean to be 2-dimensional (world_size, "
                f"num_features), but got mean of sizes {list(mean.shape)}"
            )
        if invstd.shape != mean.shape or counts.numel() < mean.size(0):
            raise RuntimeError(
                f"batch_norm_gather_stats_with_counts: invstd {list(invstd.shape)} and counts "
                f"{list(counts.shape)} do not match mean {list(mean.shape)}"
            )
        scalar = running_mean.dtype if running_mean is not None else input.dtype
        acc = accumulation_dtype(scalar)
        _expect(mean, acc, "mean")
        _expect(invstd, acc, "invstd")
        _expect(running_mean, scalar, "running_mean")
        _expect(running_var, scalar, "running_var")
        _expect(counts, scalar, "counts")
        parts = counts[: mean.size(0)].to(acc)
        if bool((parts < 1).any()):
            raise ValueError(
                "batch_norm_gather_stats_with_counts: a part with a count below 1 (CUDA gives NaN when it "
                "comes first; the caller must leave such parts out)"
            )
        total = parts.sum()
        weights = (parts / total).unsqueeze(1)
        out_mean = (weights * mean).sum(0)
        part_m2 = (invstd.reciprocal().square() - eps) * parts.unsqueeze(1)
        m2 = part_m2.sum(0) + (parts.unsqueeze(1) * (mean - out_mean).square()).sum(0)
        out_invstd = torch.rsqrt(m2 / total + eps)
        with torch.no_grad():
            if running_mean is not None:
                running_mean.copy_((1 - momentum) * running_mean.to(acc) + momentum * out_mean)
            if running_var is not None:
                unbiased = m2 / (total - 1)
                running_var.copy_((1 - momentum) * running_var.to(acc) + momentum * unbiased)
        return out_mean, out_invstd

    def batch_norm_elemt(
        self,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """See :class:`BatchNormKernels`."""
        wtype, acc = _stat_types(input, weight)
        _expect(weight, wtype, "weight")
        _expect(bias, wtype, "bias")
        _expect(mean, acc, "mean")
        _expect(invstd, acc, "invstd")
        scale = invstd if weight is None else invstd * weight.to(acc)
        shift = -mean * scale if bias is None else bias.to(acc) - mean * scale
        out = input.to(acc) * _channel(scale, input) + _channel(shift, input)
        result = torch.empty_like(input)  # the input's layout, as the kernel's output
        return result.copy_(out)

    def batch_norm_backward_reduce(
        self,
        grad_out: torch.Tensor,
        input: torch.Tensor,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        weight: torch.Tensor | None,
        input_g: bool,
        weight_g: bool,
        bias_g: bool,
    ) -> _Reduced:
        """See :class:`BatchNormKernels`."""
        _nonempty(input, "batch_norm_backward_reduce")
        if mean.dtype != invstd.dtype:
            raise RuntimeError("mean and invstd need to have the same data types")
        wtype, acc = _stat_types(input, weight)
        _expect(weight, wtype, "weight")
        _expect(mean, acc, "mean")
        if (weight_g or bias_g) and weight is None:
            raise ValueError("batch_norm_backward_reduce: weight_g and bias_g need a weight")
        dy = grad_out.to(acc)
        sum_dy = dy.sum(_dims(input))
        sum_dy_xmu = (dy * (input.to(acc) - _channel(mean, input))).sum(_dims(input))
        grad_weight = (sum_dy_xmu * invstd).to(wtype) if weight_g else None
        grad_bias = sum_dy.to(wtype) if bias_g else None
        return (sum_dy if input_g else None, sum_dy_xmu if input_g else None, grad_weight, grad_bias)

    def batch_norm_backward_elemt(
        self,
        grad_out: torch.Tensor,
        input: torch.Tensor,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        weight: torch.Tensor | None,
        sum_dy: torch.Tensor,
        sum_dy_xmu: torch.Tensor,
        count: torch.Tensor,
    ) -> torch.Tensor:
        """See :class:`BatchNormKernels`."""
        _nonempty(input, "batch_norm_backward_elemt")
        if mean.dtype != invstd.dtype:
            raise RuntimeError("mean and invstd need to have the same data types")
        acc = accumulation_dtype(input.dtype)
        mixed = input.dtype in _LOW and mean.dtype == torch.float32
        wtype = acc if mixed else input.dtype
        _expect(weight, wtype, "weight")
        for t, what in ((mean, "mean"), (invstd, "invstd"), (sum_dy, "sum_dy"), (sum_dy_xmu, "sum_dy_xmu")):
            _expect(t, acc, what)
        _expect(count, torch.int32, "count")
        norm = 1.0 / float(count.sum())
        scale = invstd if weight is None else invstd * weight.to(acc)
        centered = input.to(acc) - _channel(mean, input)
        dx = (grad_out.to(acc) - _channel(sum_dy * norm, input)) - centered * _channel(
            invstd * invstd * sum_dy_xmu * norm, input
        )
        out = dx * _channel(scale, input)
        result = torch.empty(input.shape, dtype=input.dtype, device=input.device).contiguous(
            memory_format=torch.channels_last
            if input.dim() == 4 and input.is_contiguous(memory_format=torch.channels_last)
            else torch.contiguous_format
        )
        return result.copy_(out)


TORCH_KERNELS = TorchKernels()
"""torch's operators: for CUDA tensors when :func:`fused_kernels_available`."""

REFERENCE_KERNELS = ReferenceKernels()
"""The pure-torch stand-ins: any device; what the CPU tests and the op-count benchmark drive the path with."""


@functools.lru_cache(maxsize=1)
def fused_kernels_available() -> bool:
    """Whether this torch has the five operators (every release from 2.4 has; checked, not assumed)."""
    return all(callable(getattr(torch, name, None)) for name in FUSED_OPS)


def kernels_for(device: torch.device, override: BatchNormKernels | None = None) -> BatchNormKernels | None:
    """The kernel set a training batch norm on ``device`` uses; ``None`` selects the composite path.

    Args:
        device: The input's device.
        override: A module's own kernel set (tests, benchmarks): used on every device.

    Returns:
        ``override`` if given; :data:`TORCH_KERNELS` for a CUDA device when this torch has the operators;
        ``None`` otherwise (CPU keeps its float64 composite numerics).
    """
    if override is not None:
        return override
    if device.type == "cuda" and fused_kernels_available():
        return TORCH_KERNELS
    return None
