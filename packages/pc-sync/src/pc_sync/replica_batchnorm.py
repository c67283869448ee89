"""Batch norm whose training statistics span every replica of a data-parallel forward.

Outside a training replica (eval, no replication, a single replica) each class *is* its torch parent:
``forward`` calls ``super().forward``. Inside a training replica (after ``__data_parallel_replicate__``)::

    replica k: x_k ──► (mean_k, M2_k, n_k) ──► master (copy 0): Chan combine ──► (mean, inv_std)
                                                          │ running stats: in place, once per call
    replica k: y_k = (x_k - mean) * (inv_std * weight) + bias ◄───┘

The exchanged messages are tensors that stay in the autograd graph (never detached), so ``loss.backward()`` --
which runs every CPU node in the caller's thread -- sums the contributions of all replicas with no
communication in backward and therefore cannot deadlock.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, cast

import torch
from torch import nn

from pc_sync._autograd import _Handoff, local_stats, normalize
from pc_sync._fused import FusedLayer, FusedMessage, fusable, gather_replicas, replica_batch_norm
from pc_sync._torch_bn import BatchNormKernels, kernels_for
from pc_sync.comm import SlavePipe, SyncMaster, check_timeout
from pc_sync.errors import DEFAULT_SYNC_TIMEOUT

__all__ = ["SynchronizedBatchNorm1d", "SynchronizedBatchNorm2d", "SynchronizedBatchNorm3d", "take_over_state"]

logger = logging.getLogger(__name__)

_LOW_PRECISION = (torch.float16, torch.bfloat16)
# torch's _BatchNorm grew a ``bias`` switch in a recent release; on older torch (2.11 and before)
# ``bias=False`` is emulated by dropping the parameter after construction; every forward path here
# already handles a missing bias.
_TORCH_BN_TAKES_BIAS = "bias" in inspect.signature(nn.modules.batchnorm._BatchNorm.__init__).parameters


class _ChildMessage(NamedTuple):
    """A replica's per-channel statistics: mean, sum of squared deviations (M2), count and input dtype."""

    mean: torch.Tensor
    m2: torch.Tensor
    n: int
    dtype: torch.dtype


class _MasterMessage(NamedTuple):
    """The whole batch's statistics, on the receiving replica's device."""

    mean: torch.Tensor
    inv_std: torch.Tensor


def _local_stats(x: torch.Tensor) -> tuple[_ChildMessage, torch.Tensor, torch.Tensor, _Handoff | None]:
    """Per-channel (mean, M2, count) of ``x``; ``x`` as the statistics' dtype, centered on its mean.

    Two passes (mean, then squared deviations) are as accurate as Welford's and several times faster than
    ``torch.var_mean`` over the non-contiguous ``(0, 2, ...)`` dims on CPU. The normalization reuses the
    centered tensor, so it is the only full-size tensor saved for backward. fp16/bf16 inputs give fp32
    statistics. The last item links the two autograd nodes of the call (``None`` for an empty input).
    """
    channels = x.size(1)
    count = x.numel() // channels if channels else 0
    xs = x.float() if x.dtype in _LOW_PRECISION else x
    if count == 0:
        # Sums over no values: zeros that stay in the graph when ``x`` requires grad, so an empty replica or
        # process records the same autograd nodes as its peers.
        dims = [0, *range(2, x.dim())]
        return _ChildMessage(xs.sum(dims), xs.sum(dims), 0, x.dtype), xs, xs, None
    mean, m2, centered, handoff = local_stats(xs)
    return _ChildMessage(mean, m2, count, x.dtype), xs, centered, handoff


def _combine(msgs: list[_ChildMessage], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Chan's parallel combination of per-replica statistics: the global (mean, M2, count).

    ``M2 = sum(M2_i + n_i * (mean_i - mean)**2)`` stays accurate for data far from zero, unlike a combination
    of sums and sums of squares. Every op is differentiable, so gradients flow back to each replica's
    statistics.
    """
    total = sum(m.n for m in msgs)
    if len(msgs) == 1:
        return msgs[0].mean, msgs[0].m2, total
    means = torch.stack([m.mean if m.mean.device == device else m.mean.to(device) for m in msgs])
    m2s = torch.stack([m.m2 if m.m2.device == device else m.m2.to(device) for m in msgs])
    counts = [m.n for m in msgs]
    if all(c == counts[0] for c in counts):  # equal chunks (the usual split): no weight tensor
        mean = means.mean(0)
        m2 = torch.add(m2s.sum(0), (means - mean).square().sum(0), alpha=counts[0])
        return mean, m2, total
    weights = torch.tensor(counts, dtype=means.dtype, device=device).unsqueeze(1)
    mean = (means * weights).sum(0) / total
    m2 = m2s.sum(0) + (weights * (means - mean).square()).sum(0)
    return mean, m2, total


class _SyncBNMixin(nn.Module):
    """The cross-replica behaviour shared by the three synchronized batch-norm classes."""

    # Provided by the torch.nn.BatchNorm* parent class.
    num_features: int
    eps: float
    momentum: float | None
    track_running_stats: bool
    running_mean: torch.Tensor | None
    running_var: torch.Tensor | None
    num_batches_tracked: torch.Tensor | None
    _check_input_dim: Callable[[torch.Tensor], None]

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: torch.device | str | int | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
        sync_timeout: float = DEFAULT_SYNC_TIMEOUT,
    ) -> None:
        timeout = check_timeout(sync_timeout)
        if _TORCH_BN_TAKES_BIAS:
            super().__init__(
                num_features, eps, momentum, affine, track_running_stats, device, dtype, bias=bias
            )
        else:
            super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
            if not bias:
                self.register_parameter("bias", None)
        self.sync_timeout = timeout
        self._sync_master: SyncMaster | None = None
        self._slave_pipe: SlavePipe | None = None
        # A kernel set used on every device instead of the one chosen per device (tests, benchmarks).
        self._bn_kernels: BatchNormKernels | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Replica-only links to live peers are dropped: a pickled replica is a plain module.
        state = self.__dict__.copy()
        state["_sync_master"] = None
        state["_slave_pipe"] = None
        return state

    def __data_parallel_replicate__(self, ctx: Any, copy_id: int) -> None:
        """Link this replica to its peers (called by the replication callback on every copy, copy 0 first).

        Copy 0 creates a fresh :class:`~pc_sync.SyncMaster` per replication and stores it in ``ctx``; every
        other copy registers as a slave. The original module is never touched.

        Args:
            ctx: The context object shared by the copies of this module in one replication.
            copy_id: The replica index; 0 is the master.
        """
        if copy_id == 0:
            ctx.sync_master = SyncMaster(self._data_parallel_master)
            self._slave_pipe = None
        else:
            master = getattr(ctx, "sync_master", None)
            if not isinstance(master, SyncMaster):
                raise RuntimeError(
                    f"replica {copy_id} was set up before replica 0: "
                    "replication callbacks must run on copy 0 first"
                )
            self._slave_pipe = master.register_slave(copy_id)
        self._sync_master = ctx.sync_master

    def __data_parallel_abort__(self, exc: BaseException) -> None:
        """Release every replica waiting on this module's exchange (called when some replica failed).

        Args:
            exc: The error of the failing replica; waiting replicas raise ``SyncAbortedError`` chained to it.
        """
        if self._sync_master is not None:
            self._sync_master.abort(exc)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input``; in a training replica, with the statistics of the whole batch.

        Args:
            input: A tensor of shape ``(N, C, ...)`` as the parent ``torch.nn.BatchNorm*`` accepts.

        Returns:
            The normalized tensor, of the input's shape and dtype.

        Raises:
            ValueError: On a wrong input rank, or a single value per channel in training (as torch).
            RuntimeError: On a channel count other than ``num_features``.
            SyncTimeoutError: If a peer replica did not reach this module within ``sync_timeout`` seconds.
            SyncAbortedError: If another replica failed during the exchange.
        """
        master = self._sync_master
        if not self.training or master is None:
            return super().forward(input)  # type: ignore[no-any-return]
        self._check_input_dim(input)
        if input.size(1) != self.num_features:
            raise RuntimeError(
                f"{type(self).__name__}: expected input with {self.num_features} channels (dim 1), "
                f"got input of shape {tuple(input.shape)}"
            )
        pipe = self._slave_pipe
        if pipe is None and master.nr_slaves == 0:
            return super().forward(input)  # type: ignore[no-any-return]
        return self._replica_forward(input, master, pipe)

    def _replica_forward(
        self, input: torch.Tensor, master: SyncMaster, pipe: SlavePipe | None
    ) -> torch.Tensor:
        """A training replica's forward: local statistics, one round with the other replicas, normalization.

        On the fused kernels where the device has them (``pc_sync._fused``), else the composite path.
        """
        kernels = self._kernels(input)
        if kernels is not None:
            if pipe is None:
                exchange = functools.partial(master.run_master, timeout=self.sync_timeout)
            else:
                exchange = functools.partial(pipe.run_slave, timeout=self.sync_timeout)
            with torch.autocast(input.device.type, enabled=False):
                weight = cast("torch.Tensor | None", self.weight)
                bias = cast("torch.Tensor | None", self.bias)
                return replica_batch_norm(input, weight, bias, kernels, self.eps, exchange)
        msg, xs, centered, handoff = _local_stats(input)
        if pipe is None:
            reply = master.run_master(msg, timeout=self.sync_timeout)
        else:
            reply = pipe.run_slave(msg, timeout=self.sync_timeout)
        return self._normalize(xs, centered, msg.mean, reply, handoff).to(input.dtype)

    def _kernels(self, input: torch.Tensor) -> BatchNormKernels | None:
        """The fused kernel set for ``input`` (``None``: the composite path): see ``pc_sync._torch_bn``."""
        override = self.__dict__.get("_bn_kernels")
        if override is None and input.device.type != "cuda":  # the common CPU case, decided at once
            return None
        kernels = kernels_for(input.device, override)
        if kernels is None:
            return None
        params = (self.weight, self.bias, self.running_mean, self.running_var)
        return kernels if fusable(input, *cast("tuple[torch.Tensor | None, ...]", params)) else None

    def _fused_layer(self, kernels: BatchNormKernels, replicas: int) -> FusedLayer:
        """What the fused orchestration needs of this module (the master replica) for one call."""
        tracks = self.track_running_stats and self.running_mean is not None
        return FusedLayer(
            kernels=kernels,
            eps=self.eps,
            weight=cast("torch.Tensor | None", self.weight),
            running_mean=self.running_mean if tracks else None,
            running_var=self.running_var if tracks else None,
            momentum=self._momentum_factor if tracks else float,
            across=self._spans_processes(),
            group=getattr(self, "process_group", None),
            scope=f" across {replicas} replica(s){self._scope()}",
        )

    def _spans_processes(self) -> bool:
        """Whether the statistics span processes beyond this process's replicas (a subclass's group)."""
        return False

    def _normalize(
        self,
        x: torch.Tensor,
        centered: torch.Tensor,
        local_mean: torch.Tensor,
        stats: _MasterMessage,
        handoff: _Handoff | None,
    ) -> torch.Tensor:
        """``(x - mean) * scale + bias``, computed as ``centered * scale + shift``.

        ``x - mean == centered - (mean - local_mean)``: the shift holds only the (small) difference of the
        means, so large offsets cancel exactly in ``centered`` and nothing full-size is recomputed.
        """
        shape = [1, centered.size(1)] + [1] * (centered.dim() - 2)
        weight = cast("torch.Tensor | None", self.weight)
        bias = cast("torch.Tensor | None", self.bias)
        scale = stats.inv_std if weight is None else stats.inv_std * weight
        shift = (local_mean.detach() - stats.mean) * scale
        if bias is not None:
            shift = shift + bias
        if handoff is None:
            shape = [1, centered.size(1)] + [1] * (centered.dim() - 2)
            return torch.addcmul(shift.reshape(shape), centered, scale.reshape(shape))
        return normalize(x, centered, scale, shift, handoff)

    def _data_parallel_master(self, intermediates: list[tuple[Hashable, Any]]) -> list[tuple[Hashable, Any]]:
        """Combine every replica's statistics, update the running statistics once, and answer each replica."""
        kinds = {type(msg) for _, msg in intermediates}
        if kinds == {FusedMessage}:
            fused: list[FusedMessage] = [msg for _, msg in intermediates]
            layer = self._fused_layer(fused[0].kernels, len(fused))
            return list(zip([i for i, _ in intermediates], gather_replicas(layer, fused), strict=True))
        if kinds != {_ChildMessage}:
            raise TypeError(
                f"{type(self).__name__}: the replicas ran different paths (fused kernels and the composite "
                "path); every replica must be on the same kind of device"
            )
        msgs: list[_ChildMessage] = [msg for _, msg in intermediates]
        device = msgs[0].mean.device
        mean, m2, total = self._global_stats(*_combine(msgs, device), msgs)
        if total <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got {total} value(s) per channel "
                f"across {len(msgs)} replica(s){self._scope()}"
            )
        inv_std = torch.rsqrt(m2 / total + self.eps)
        self._update_running_stats(mean, m2 / (total - 1))
        same = _MasterMessage(mean, inv_std)
        return [
            (
                ident,
                same
                if m.mean.device == device
                else _MasterMessage(mean.to(m.mean.device), inv_std.to(m.mean.device)),
            )
            for ident, m in intermediates
        ]

    def _global_stats(
        self, mean: torch.Tensor, m2: torch.Tensor, total: int, msgs: list[_ChildMessage]
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The whole batch's statistics from this process's (its replicas sent ``msgs``).

        The same, unless a subclass spans processes.
        """
        return mean, m2, total

    def _scope(self) -> str:
        """Where the counted values came from beyond this process's replicas, for error messages."""
        return ""

    def _momentum_factor(self) -> float:
        """Count one training call in ``num_batches_tracked``; the factor of this call's running update."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.num_batches_tracked is not None:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        return factor

    def _update_running_stats(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        if not self.track_running_stats or self.running_mean is None or self.running_var is None:
            return
        factor = self._momentum_factor()
        with torch.no_grad():
            self.running_mean.mul_(1.0 - factor).add_(mean.detach().to(self.running_mean.dtype), alpha=factor)
            self.running_var.mul_(1.0 - factor).add_(
                unbiased_var.detach().to(self.running_var.dtype), alpha=factor
            )


class SynchronizedBatchNorm1d(_SyncBNMixin, nn.BatchNorm1d):
    """``torch.nn.BatchNorm1d`` whose training statistics span all data-parallel replicas.

    Input: ``(N, C)`` or ``(N, C, L)``. The arguments are those of :class:`SynchronizedBatchNorm2d`.
    """


class SynchronizedBatchNorm2d(_SyncBNMixin, nn.BatchNorm2d):
    """``torch.nn.BatchNorm2d`` whose training statistics span all data-parallel replicas.

    Use it under ``pc_replicate.ReplicationCallbackDataParallel`` (CUDA devices or CPU thread replicas), or
    convert a model with :func:`pc_sync.convert_model`. In a training replica it normalizes with the mean and
    biased variance of the whole batch and updates the running statistics once per call, in place, on the
    original module. Without replication, with a single replica, or in eval (also with
    ``track_running_stats=False``, which then uses local batch statistics, as ``torch.nn.SyncBatchNorm``) it
    is exactly ``torch.nn.BatchNorm2d``. Input: ``(N, C, H, W)``.

    Args:
        num_features: The number of channels ``C``.
        eps: Added to the variance for numerical stability.
        momentum: The running-statistics factor; ``None`` means a cumulative average.
        affine: Whether the module has learnable ``weight`` and ``bias``.
        track_running_stats: Whether the module keeps running statistics (used in eval).
        device: Device of the parameters and buffers.
        dtype: Dtype of the parameters and buffers.
        bias: With ``affine``, whether the module has a learnable ``bias``.
        sync_timeout: Seconds a replica waits for its peers in one exchange before ``SyncTimeoutError``.

    Examples:
        >>> import torch
        >>> bn = SynchronizedBatchNorm2d(3)
        >>> bn(torch.randn(4, 3, 2, 2)).shape
        torch.Size([4, 3, 2, 2])
    """


class SynchronizedBatchNorm3d(_SyncBNMixin, nn.BatchNorm3d):
    """``torch.nn.BatchNorm3d`` whose training statistics span all data-parallel replicas.

    Input: ``(N, C, D, H, W)``. The arguments are those of :class:`SynchronizedBatchNorm2d`.
    """


def take_over_state(new: nn.Module, old: nn.Module, what: str) -> None:
    """Give ``new`` (built on the meta device) ``old``'s own parameters, buffers, mode and ``qconfig``.

    The tensors are the same objects, not copies, so an optimizer built before a conversion keeps updating
    the converted model. ``what`` names the converter in the error raised when a tensor is left on the meta
    device (the torch class grew state this function does not hand over).
    """
    for name, param in old.named_parameters(recurse=False):
        setattr(new, name, param)
    for name, buf in old.named_buffers(recurse=False):
        setattr(new, name, buf)
    new.train(old.training)
    if hasattr(old, "qconfig"):
        new.qconfig = old.qconfig
    leftover = [n for n, t in [*new.named_parameters(), *new.named_buffers()] if t.device.type == "meta"]
    if leftover:
        raise RuntimeError(f"{what} could not transfer {leftover} to {type(new).__name__}")
