"""A training batch norm on torch's fused batch-norm kernels: the CUDA path of the replicas and of processes.

The kernels (``pc_sync._torch_bn``) do the full-size work in one pass each; what is left to this module is the
orchestration, with as few small ops as the exchange allows::

    replica k:  x_k ─► _Stats: stats ─► (mean_k, invstd_k, n_k) ─┐
    master:     _Gather: gather_stats_with_counts, running statistics [+ process exchange] ─► (mean, invstd)
    replica k:  _Elemt: elemt(x_k, weight, bias, mean, invstd) ─► y_k

    backward:   _Elemt_k: backward_reduce ─► (sum_dy_k, sum_dy_xmu_k) ─► autograd sums them over the replicas
                _Gather: [the process exchange] ─► (sum_dy, sum_dy_xmu) of the whole batch ─► every _Stats_k
                _Stats_k: backward_elemt(dy_k, x_k, ...) ─► dx_k

    a process without replicas (DDP): _Process, one node: stats, exchange, gather, elemt; backward_reduce,
    exchange, backward_elemt.

**What travels between the replicas' nodes.** As in the composite path, the replicas' messages are tensors in
the autograd graph, so ``loss.backward()`` (which runs every node of a device in one thread) needs no
communication between replicas and cannot deadlock. Here the graph between ``_Stats``, ``_Gather`` and
``_Elemt`` carries the per-channel sums the kernels need rather than gradients of the messages: ``_Elemt``
returns ``(sum_dy_k, sum_dy_xmu_k)`` as the "gradients" of ``(mean, invstd)``, autograd adds them over the
replicas, and ``_Gather`` hands the totals to every ``_Stats``. Those tensors never leave the call, so nothing
else sees them. ``_Elemt`` also hands its ``dy`` to its ``_Stats`` (which autograd runs after every ``_Elemt``
and the ``_Gather``), where ``backward_elemt`` writes the whole input gradient.

**Across processes** every path sends ``pc_sync._exchange``'s packets: forward ``(count, mean, M2)`` with
``M2 = count * (invstd**-2 - eps)``; backward the kernels' own ``(sum_dy, sum_dy_xmu)``, which the exchange
sums over the ranks as they are (``backward_elemt`` applies the local weight to the sums: every rank holds the
same weight, as DDP keeps it, and as ``torch.nn.SyncBatchNorm`` assumes).

Parts with no values (an empty replica or rank) never reach a kernel: their statistics are zeros, their
output is empty, they still record their nodes and take part in the exchanges, and the gathers leave them out
(the kernel's combination is undefined for a leading empty part). Small constant tensors (the counts the
gather and ``backward_elemt`` read) are cached per value and device, so a steady training loop creates none.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch
from torch.autograd.function import once_differentiable

from pc_sync._exchange import exchange_gradients, exchange_statistics_table
from pc_sync._torch_bn import BatchNormKernels, accumulation_dtype

__all__ = ["FusedLayer", "FusedMessage", "FusedReply", "fusable", "gather_replicas", "process_batch_norm"]

_CACHE_SIZE = 64
_constants: collections.OrderedDict[tuple[Any, ...], torch.Tensor] = collections.OrderedDict()
_constants_lock = threading.Lock()


def _constant(values: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A read-only device tensor of ``values``, made once per value, dtype and device (an LRU of 64)."""
    key = (values, dtype, device)
    with _constants_lock:
        tensor = _constants.get(key)
        if tensor is not None:
            _constants.move_to_end(key)
            return tensor
    tensor = torch.tensor(values, dtype=dtype, device=device)
    with _constants_lock:
        _constants[key] = tensor
        while len(_constants) > _CACHE_SIZE:
            _constants.popitem(last=False)
    return tensor


def _layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` if the kernels read it in place (contiguous or channels-last), else a contiguous copy."""
    if t.is_contiguous():
        return t
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return t
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return t
    return t.contiguous()


def fusable(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """Whether the kernels take ``x`` with these weights and running statistics as they are.

    They read parameters in the input's dtype or its accumulation dtype (fp32 for fp16/bf16), and running
    statistics whose accumulation dtype is the input's; anything else keeps the composite path.
    """
    if not x.is_floating_point():
        return False
    acc = accumulation_dtype(x.dtype)
    return all(p is None or p.dtype in (x.dtype, acc) for p in params)


@dataclass
class FusedLayer:
    """What the orchestration needs of the layer; the master's module builds one per call.

    Attributes:
        kernels: The kernel set.
        eps: The layer's ``eps``.
        weight: The master replica's weight (``None`` without affine).
        running_mean: The running mean to update (``None`` without running statistics).
        running_var: The running variance to update.
        momentum: Counts the call in ``num_batches_tracked`` and returns the update factor.
        across: Whether the statistics span the processes of ``group`` (else this process's replicas).
        group: The process group (``None``: the default group).
        scope: Says where the values came from, for the error on a single value per channel.
    """

    kernels: BatchNormKernels
    eps: float
    weight: torch.Tensor | None
    running_mean: torch.Tensor | None
    running_var: torch.Tensor | None
    momentum: Callable[[], float]
    across: bool = False
    group: Any = None
    scope: str = ""


class FusedMessage(NamedTuple):
    """A replica's statistics for the master: mean, invstd, count, input dtype, the input, the kernels."""

    mean: torch.Tensor
    invstd: torch.Tensor
    n: int
    dtype: torch.dtype
    input: torch.Tensor
    kernels: BatchNormKernels


class FusedReply(NamedTuple):
    """The whole batch's ``(mean, invstd)`` and its count (an int32 tensor), on the replica's device."""

    mean: torch.Tensor
    invstd: torch.Tensor
    total: torch.Tensor


@dataclass
class _Handoff:
    """One replica's link from ``_Elemt`` (forward: the statistics; backward: ``dy``) to its ``_Stats``."""

    saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None
    grad: torch.Tensor | None = None


# ------------------------------------------------------------------------------------------------ replicas
class _Stats(torch.autograd.Function):
    """``x -> (mean, invstd)`` of one replica; backward writes ``dx`` with ``backward_elemt``."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, kernels: BatchNormKernels, eps: float, handoff: _Handoff
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(x)
        ctx.kernels = kernels
        ctx.handoff = handoff
        ctx.set_materialize_grads(False)
        if x.numel() == 0:
            zeros = x.new_zeros(x.size(1), dtype=accumulation_dtype(x.dtype))
            return zeros, zeros.clone()
        return kernels.batch_norm_stats(x, eps)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, sum_dy: torch.Tensor | None, sum_dy_xmu: torch.Tensor | None) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        handoff: _Handoff = ctx.handoff
        saved, dy = handoff.saved, handoff.grad
        handoff.grad = None
        if x.numel() == 0 or saved is None:
            return torch.zeros_like(x), None, None, None
        mean, invstd, weight, count = saved
        if sum_dy is None or sum_dy_xmu is None:  # no replica's output reached the loss
            sum_dy = torch.zeros_like(mean) if sum_dy is None else sum_dy
            sum_dy_xmu = torch.zeros_like(mean) if sum_dy_xmu is None else sum_dy_xmu
        if dy is None:  # this replica's output did not, the others' did: its x still moved the statistics
            dy = torch.zeros_like(x)
        dx = ctx.kernels.batch_norm_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count)
        return dx, None, None, None


class _Elemt(torch.autograd.Function):
    """``(x, weight, bias, mean, invstd) -> y``; backward: the sums for the statistics, the parameters'."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        count: torch.Tensor,
        kernels: BatchNormKernels,
        eps: float,
        handoff: _Handoff,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.kernels = kernels
        ctx.handoff = handoff
        ctx.set_materialize_grads(False)
        w_elemt = weight if weight is None or weight.dtype == mean.dtype else weight.to(mean.dtype)
        handoff.saved = (mean.detach(), invstd.detach(), w_elemt, count)
        if x.numel() == 0:
            return torch.empty_like(x)
        return kernels.batch_norm_elemt(x, weight, bias, mean, invstd, eps)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor | None) -> tuple[Any, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        needs = ctx.needs_input_grad
        rest = (None,) * 4
        if dy is None or x.numel() == 0:
            zeros = torch.zeros_like(mean) if needs[3] or needs[4] else None
            return None, None, None, zeros, zeros, *rest
        dy = _layout(dy)
        if needs[0]:
            ctx.handoff.grad = dy
        sum_dy, sum_dy_xmu, grad_w, grad_b = ctx.kernels.batch_norm_backward_reduce(
            dy, x, mean, invstd, weight, needs[3] or needs[4], needs[1], needs[2]
        )
        return None, grad_w, grad_b, sum_dy, sum_dy_xmu, *rest


@dataclass
class _GatherCall:
    """One master call: the layer, the parts' counts and inputs, and what backward needs of forward."""

    layer: FusedLayer
    counts: list[int]
    inputs: list[torch.Tensor]
    dtype: torch.dtype
    records: bool
    replicas: int
    total: int = 0
    ordinal: int | None = None
    count: torch.Tensor | None = None


def _gather_kernel(
    layer: FusedLayer,
    x: torch.Tensor,
    means: torch.Tensor,
    invstds: torch.Tensor,
    counts: Sequence[int],
    running: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_norm_gather_stats_with_counts`` of ``(R, C)`` parts that all have values.

    With ``running`` the running statistics are updated (the call counted in ``num_batches_tracked``).
    """
    running_mean = layer.running_mean if running else None
    running_var = layer.running_var if running else None
    momentum = layer.momentum() if running else 0.0
    scalar = running_mean.dtype if running_mean is not None else x.dtype
    counts_t = _constant(tuple(counts), scalar, x.device)
    return layer.kernels.batch_norm_gather_stats_with_counts(
        x, means, invstds, running_mean, running_var, momentum, layer.eps, counts_t
    )


def _combine_replicas(
    layer: FusedLayer,
    x: torch.Tensor,
    means: Sequence[torch.Tensor],
    invstds: Sequence[torch.Tensor],
    counts: Sequence[int],
    running: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The replicas' statistics combined (those with values; the caller made sure there is one)."""
    rows = [i for i, n in enumerate(counts) if n > 0]
    if len(rows) < len(counts):
        means, invstds, counts = (
            [means[i] for i in rows],
            [invstds[i] for i in rows],
            [counts[i] for i in rows],
        )
    return _gather_kernel(layer, x, torch.stack(list(means)), torch.stack(list(invstds)), counts, running)


def _across(
    call: _GatherCall, x: torch.Tensor, mean_p: torch.Tensor, invstd_p: torch.Tensor, count_p: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The process exchange: this process's ``(mean, invstd, count)`` -> the whole batch's ``(mean, invstd)``.

    The gathered parts are combined by the kernel, which also updates the running statistics.
    """
    layer = call.layer
    # M2 from invstd = (M2 / n + eps) ** -0.5; an empty part's statistics are zeros
    m2_p = invstd_p.pow(-2).sub_(layer.eps).mul_(count_p) if count_p > 0 else torch.zeros_like(invstd_p)
    table = exchange_statistics_table(
        mean_p,
        m2_p,
        count_p,
        records=call.records,
        replicas=call.replicas,
        dtype=call.dtype,
        group=layer.group,
    )
    call.ordinal = table.ordinal
    counts = table.counts
    call.total = _check_total(counts, layer)
    acc = accumulation_dtype(x.dtype)
    payload = table.payload
    rows = [i for i, n in enumerate(counts) if n > 0]
    if len(rows) < len(counts):
        payload = payload.index_select(0, torch.tensor(rows, device=payload.device))
        counts = [counts[i] for i in rows]
    payload = payload.to(acc)
    denominators = _constant(tuple(counts), acc, payload.device).unsqueeze(1)
    invstds = (payload[:, 1] / denominators).add_(layer.eps).rsqrt_()
    return _gather_kernel(layer, x, payload[:, 0], invstds, counts, running=True)


def _check_total(counts: Sequence[int], layer: FusedLayer) -> int:
    total = sum(counts)
    if total <= 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got {total} value(s) per channel"
            f"{layer.scope}"
        )
    return total


class _Gather(torch.autograd.Function):
    """The master's ``(mean_k, invstd_k) for every replica -> (mean, invstd)`` of the whole batch."""

    @staticmethod
    def forward(ctx: Any, call: _GatherCall, *stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layer = call.layer
        k = len(call.counts)
        means, invstds = stats[:k], stats[k:]
        x = call.inputs[0]
        count_p = sum(call.counts)
        if not layer.across:
            call.total = _check_total(call.counts, layer)
            mean, invstd = _combine_replicas(layer, x, means, invstds, call.counts, running=True)
        else:
            # this process's statistics first (a single part with values is its own), then the processes'
            with_values = [i for i, n in enumerate(call.counts) if n > 0]
            if len(with_values) == 1:
                mean_p, invstd_p = means[with_values[0]], invstds[with_values[0]]
            elif with_values:
                mean_p, invstd_p = _combine_replicas(layer, x, means, invstds, call.counts, running=False)
            else:
                mean_p, invstd_p = means[0], invstds[0]
            mean, invstd = _across(call, x, mean_p, invstd_p, count_p)
        call.count = _constant((call.total,), torch.int32, mean.device)
        ctx.call = call
        ctx.k = k
        ctx.save_for_backward(invstd)
        ctx.set_materialize_grads(False)
        return mean, invstd

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, sum_dy: torch.Tensor | None, sum_dy_xmu: torch.Tensor | None) -> tuple[Any, ...]:
        call: _GatherCall = ctx.call
        (invstd,) = ctx.saved_tensors
        if call.ordinal is not None:  # the process exchange, whatever this process's replicas sent
            sum_dy = torch.zeros_like(invstd) if sum_dy is None else sum_dy
            sum_dy_xmu = torch.zeros_like(invstd) if sum_dy_xmu is None else sum_dy_xmu
            summed = exchange_gradients(
                sum_dy, sum_dy_xmu, ordinal=call.ordinal, dtype=call.dtype, group=call.layer.group
            ).to(invstd.dtype)
            sum_dy, sum_dy_xmu = summed[0], summed[1]
        return None, *([sum_dy] * ctx.k), *([sum_dy_xmu] * ctx.k)


def fused_stats(x: torch.Tensor, kernels: BatchNormKernels, eps: float, handoff: _Handoff) -> FusedMessage:
    """A replica's message: its statistics (zeros for an empty ``x``), in the autograd graph."""
    mean, invstd = _Stats.apply(x, kernels, eps, handoff)  # type: ignore[no-untyped-call]
    return FusedMessage(mean, invstd, x.numel() // x.size(1), x.dtype, x, kernels)


def gather_replicas(layer: FusedLayer, msgs: list[FusedMessage]) -> list[FusedReply]:
    """The master's callback: combine the replicas' statistics (and the processes'), answer each replica.

    Raises:
        ValueError: If the whole batch has a single value per channel, or the processes' calls differ.
    """
    device = msgs[0].mean.device
    means = [m.mean if m.mean.device == device else m.mean.to(device) for m in msgs]
    invstds = [m.invstd if m.invstd.device == device else m.invstd.to(device) for m in msgs]
    records = torch.is_grad_enabled() and any(t.requires_grad for t in means)
    call = _GatherCall(layer, [m.n for m in msgs], [m.input for m in msgs], msgs[0].dtype, records, len(msgs))
    mean, invstd = _Gather.apply(call, *means, *invstds)  # type: ignore[no-untyped-call]
    count = cast("torch.Tensor", call.count)  # set by _Gather.forward
    same = FusedReply(mean, invstd, count)
    return [
        same
        if m.mean.device == device
        else FusedReply(mean.to(m.mean.device), invstd.to(m.mean.device), count.to(m.mean.device))
        for m in msgs
    ]


def fused_elemt(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    reply: FusedReply,
    kernels: BatchNormKernels,
    eps: float,
    handoff: _Handoff,
) -> torch.Tensor:
    """A replica's output with the whole batch's statistics."""
    out: torch.Tensor = _Elemt.apply(  # type: ignore[no-untyped-call]
        x, weight, bias, reply.mean, reply.invstd, reply.total, kernels, eps, handoff
    )
    return out


def replica_batch_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    kernels: BatchNormKernels,
    eps: float,
    exchange: Callable[[FusedMessage], Any],
) -> torch.Tensor:
    """One replica's training forward: statistics, the replicas' round (``exchange``), normalization."""
    x = _layout(x)
    handoff = _Handoff()
    reply = exchange(fused_stats(x, kernels, eps, handoff))
    if not isinstance(reply, FusedReply):
        raise TypeError(f"the master answered a fused replica with {type(reply).__name__}")
    return fused_elemt(x, weight, bias, reply, kernels, eps, handoff)


# ----------------------------------------------------------------------------------- processes, no replicas
class _Process(torch.autograd.Function):
    """``(x, weight, bias) -> y`` over the processes of a group: one node, one exchange each way."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        call: _GatherCall,
    ) -> torch.Tensor:
        layer = call.layer
        kernels = layer.kernels
        count_p = call.counts[0]
        if count_p > 0:
            mean_p, invstd_p = kernels.batch_norm_stats(x, layer.eps)
        else:
            mean_p = x.new_zeros(x.size(1), dtype=accumulation_dtype(x.dtype))
            invstd_p = mean_p
        mean, invstd = _across(call, x, mean_p, invstd_p, count_p)
        count = _constant((call.total,), torch.int32, x.device)
        w = weight if weight is None or weight.dtype == mean.dtype else weight.to(mean.dtype)
        ctx.save_for_backward(x, weight, mean, invstd, count, w)
        ctx.call = call
        ctx.set_materialize_grads(False)
        if count_p == 0:
            return torch.empty_like(x)
        return kernels.batch_norm_elemt(x, weight, bias, mean, invstd, layer.eps)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor | None) -> tuple[Any, ...]:
        x, weight, mean, invstd, count, w = ctx.saved_tensors
        call: _GatherCall = ctx.call
        kernels = call.layer.kernels
        needs_x, needs_w, needs_b = ctx.needs_input_grad[:3]
        if x.numel() > 0:
            dy = torch.zeros_like(x) if dy is None else _layout(dy)
            sum_dy, sum_dy_xmu, grad_w, grad_b = kernels.batch_norm_backward_reduce(
                dy, x, mean, invstd, weight, needs_x, needs_w, needs_b
            )
        else:
            sum_dy = sum_dy_xmu = torch.zeros_like(mean) if needs_x else None
            grad_w = grad_b = None
        if not needs_x or sum_dy is None or sum_dy_xmu is None or call.ordinal is None:
            return None, grad_w, grad_b, None
        summed = exchange_gradients(
            sum_dy, sum_dy_xmu, ordinal=call.ordinal, dtype=call.dtype, group=call.layer.group
        ).to(mean.dtype)
        if x.numel() == 0:
            return torch.zeros_like(x), grad_w, grad_b, None
        dx = kernels.batch_norm_backward_elemt(
            cast("torch.Tensor", dy), x, mean, invstd, w, summed[0], summed[1], count
        )
        return dx, grad_w, grad_b, None


def process_batch_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    layer: FusedLayer,
    replicas: int,
) -> torch.Tensor:
    """The training forward of a process without replicas (or with one) over ``layer.group``.

    Raises:
        ValueError: If the whole batch has a single value per channel, or the processes' calls differ.
    """
    x = _layout(x)
    records = torch.is_grad_enabled() and x.requires_grad
    call = _GatherCall(layer, [x.numel() // x.size(1)], [x], x.dtype, records, replicas)
    out: torch.Tensor = _Process.apply(x, weight, bias, call)  # type: ignore[no-untyped-call]
    return out
