"""``SyncBatchNorm``: batch norm whose training statistics span the replicas of a process and the processes.

Two levels, one collective per layer call::

    process p, replica k: x_pk ─► (mean, M2, n)_pk ─► replica 0 of p: Chan combine ─► (mean, M2, n)_p
    replica 0 of p: all_gather over the process group ─► Chan combine in rank order ─► (mean, M2, N)
    replica 0 of p: running statistics, inv_std ─► every replica of p normalizes with the global statistics

Inside a process the replicas exchange autograd-tracked tensors through a :class:`~pc_sync.SyncMaster`, as
:class:`~pc_sync.SynchronizedBatchNorm2d` does; across processes forward makes one ``all_gather`` and backward
one exchange (see ``pc_sync._process_stats``). Without replicas the first level is skipped and the layer
is a single autograd node (``pc_sync._unreplicated``); with a one-process group (or no initialized
``torch.distributed``) the second level is skipped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from pc_sync._checks import positive_int
from pc_sync._exchange import group_size
from pc_sync._fused import process_batch_norm
from pc_sync._process_stats import exchange_statistics, reduce_across_processes
from pc_sync._unreplicated import batch_norm_across, local_moments
from pc_sync.errors import DEFAULT_SYNC_TIMEOUT
from pc_sync.replica_batchnorm import _LOW_PRECISION, _ChildMessage, _SyncBNMixin, take_over_state

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


def _batch_norm_base() -> type[nn.Module]:
    """The common base of torch's batch norms (``nn.BatchNorm1d/2d/3d``, lazy ones, ``nn.SyncBatchNorm``).

    Found through the public classes' MRO rather than by its private name.
    """
    for cls in nn.BatchNorm1d.__mro__:
        if issubclass(nn.BatchNorm2d, cls) and issubclass(nn.SyncBatchNorm, cls) and cls is not nn.Module:
            return cls
    raise ImportError("torch's batch-norm classes share no base class below torch.nn.Module")


if TYPE_CHECKING:
    from torch.nn.modules.batchnorm import _BatchNorm as _BatchNormBase
else:
    _BatchNormBase = _batch_norm_base()

_LAZY_BN = (nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d)


class SyncBatchNorm(_SyncBNMixin, _BatchNormBase):
    """Batch norm over 2-D to 5-D inputs whose training statistics are those of the whole global batch.

    A drop-in for ``torch.nn.SyncBatchNorm`` (same constructor, parameters, buffers and state_dict keys) that
    also runs on CPU tensors (gloo), under ``torch.nn.parallel.DistributedDataParallel`` and
    ``pc_distributed.DataParallel``, and under pc-replicate's replicas inside each process: in training it
    normalizes with the mean and biased variance of every replica's batch on every process of
    ``process_group`` and updates the running statistics once per call, identically on every process.

    Collective in training: every process of the group must call each ``SyncBatchNorm`` equally often and in
    the same order, also with an empty batch, and run backward through it when the others do. Eval mode makes
    no collective (running statistics, or with ``track_running_stats=False`` the local batch's). Without an
    initialized ``torch.distributed``, with a one-process group and no replicas it is a plain batch norm.

    Args:
        num_features: The number of channels ``C`` of an ``(N, C, ...)`` input.
        eps: Added to the variance for numerical stability.
        momentum: The running-statistics factor; ``None`` means a cumulative average.
        affine: Whether the module has learnable ``weight`` and ``bias``.
        track_running_stats: Whether the module keeps running statistics (used in eval).
        process_group: The ``torch.distributed`` group to synchronize over; ``None`` is the default group.
        device: Device of the parameters and buffers.
        dtype: Dtype of the parameters and buffers.
        bias: With ``affine``, whether the module has a learnable ``bias`` (keyword-only, as in recent torch).
        sync_timeout: Seconds a replica waits for the replicas of its own process; the process group's own
            timeout bounds the wait for other processes.

    Examples:
        >>> import torch
        >>> bn = SyncBatchNorm(3)  # no process group: a plain batch norm
        >>> bn(torch.randn(4, 3, 2, 2)).shape
        torch.Size([4, 3, 2, 2])
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: torch.device | str | int | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
        sync_timeout: float = DEFAULT_SYNC_TIMEOUT,
    ) -> None:
        positive_int("num_features", num_features)
        super().__init__(
            num_features,
            eps,
            momentum,
            affine,
            track_running_stats,
            device,
            dtype,
            bias=bias,
            sync_timeout=sync_timeout,
        )
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"SyncBatchNorm expects a torch.Tensor, got {type(input).__name__}")
        if not 2 <= input.dim() <= 5:
            raise ValueError(
                f"SyncBatchNorm expects a 2-D to 5-D input (N, C, ...), got a {input.dim()}-D input of shape "
                f"{tuple(input.shape)}"
            )
        if input.size(1) != self.num_features:
            raise ValueError(
                f"SyncBatchNorm expects {self.num_features} channels (dim 1), got input of shape "
                f"{tuple(input.shape)}"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input``; in training, with the statistics of the whole global batch.

        Args:
            input: A tensor of shape ``(N, C)`` to ``(N, C, D, H, W)``, in any memory format; ``N`` may be 0.

        Returns:
            The normalized tensor, of the input's shape and dtype (fp16/bf16 inputs get fp32 statistics).

        Raises:
            TypeError: If ``input`` is not a tensor.
            ValueError: On a 1-D or 6-D input, a channel count other than ``num_features``, or a single value
                per channel in the whole training batch.
            ConnectionError: If a peer process failed or left during an exchange.
            TimeoutError: If a peer process did not reach this layer within the process group's timeout.
            SyncTimeoutError: If a replica of this process did not reach this layer within ``sync_timeout``.
        """
        self._check_input_dim(input)
        if not self.training:
            return _BatchNormBase.forward(self, input)
        master = self._sync_master
        pipe = self._slave_pipe
        if master is not None and (pipe is not None or master.nr_slaves > 0):
            with torch.autocast(input.device.type, enabled=False):
                return self._replica_forward(input, master, pipe)
        if group_size(self.process_group) == 1:
            return _BatchNormBase.forward(self, input)
        replicas = 0 if master is None else 1
        with torch.autocast(input.device.type, enabled=False):
            kernels = self._kernels(input)
            if kernels is not None:
                weight = cast("torch.Tensor | None", self.weight)
                bias = cast("torch.Tensor | None", self.bias)
                return process_batch_norm(input, weight, bias, self._fused_layer(kernels, 1), replicas)
            return self._across_processes(input, replicas)

    def _across_processes(self, input: torch.Tensor, replicas: int) -> torch.Tensor:
        """The training forward of a process without replicas (or one): one exchange, one autograd node."""
        xs = input.float() if input.dtype in _LOW_PRECISION else input
        group = self.process_group
        records = torch.is_grad_enabled() and xs.requires_grad
        mean_p, m2_p, centered, count = local_moments(xs)
        mean, m2, total, ordinal = exchange_statistics(
            mean_p, m2_p, count, records, group, replicas=replicas, dtype=input.dtype
        )
        if total <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got {total} value(s) per channel "
                f"across 1 replica(s){self._scope()}"
            )
        var = m2 / total
        self._update_running_stats(mean, m2 / (total - 1))
        shift = (mean - mean_p.to(mean.dtype)).to(xs.dtype)
        out = batch_norm_across(
            xs,
            cast("torch.Tensor | None", self.weight),
            cast("torch.Tensor | None", self.bias),
            centered,
            shift,
            var.to(xs.dtype),
            self.eps,
            total,
            group,
            ordinal,
            input.dtype,
        )
        return out.to(input.dtype)

    def _global_stats(
        self, mean: torch.Tensor, m2: torch.Tensor, total: int, msgs: list[_ChildMessage]
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        if group_size(self.process_group) == 1:
            return mean, m2, total
        return reduce_across_processes(
            mean,
            m2,
            total,
            self.process_group,
            replicas=len(msgs),
            dtype=msgs[0].dtype,
            weight=cast("torch.Tensor | None", self.weight),
            eps=self.eps,
        )

    def _spans_processes(self) -> bool:
        return group_size(self.process_group) > 1

    def _scope(self) -> str:
        size = group_size(self.process_group)
        return f" and {size} processes" if size > 1 else ""

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: Any = None) -> nn.Module:
        """Every batch norm in ``module`` becomes a ``SyncBatchNorm``: see :func:`convert_sync_batchnorm`."""
        return convert_sync_batchnorm(module, process_group)


def convert_sync_batchnorm(module: nn.Module, process_group: Any = None) -> nn.Module:
    """Replace every batch norm in ``module`` (itself included) by a ``SyncBatchNorm`` over ``process_group``.

    As ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``: every torch batch norm (``nn.BatchNorm1d/2d/3d``,
    ``nn.SyncBatchNorm``, pc-sync's replica classes, a ``SyncBatchNorm``, and subclasses of these, whose
    overrides are dropped) becomes a ``SyncBatchNorm`` that takes over **the same** Parameter and buffer
    objects (so the device, the dtype and an existing optimizer stay valid), the hyper-parameters, the
    training flag and ``qconfig``. Children are replaced on their parents in place.

    Args:
        module: The model to convert.
        process_group: The group the converted layers synchronize over; ``None`` is the default group.

    Returns:
        The converted model: ``module`` itself unless it is a batch norm.

    Raises:
        TypeError: If ``module`` is not an ``nn.Module``.
        ValueError: If the model holds an uninitialized lazy batch norm (run one forward first).

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> net = convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
        >>> type(net[1]).__name__
        'SyncBatchNorm'
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"convert_sync_batchnorm expects a torch.nn.Module, got {type(module).__name__}")
    out = module
    if isinstance(module, _LAZY_BN):
        raise ValueError(
            f"cannot convert an uninitialized {type(module).__name__}: run one forward to initialize it first"
        )
    if isinstance(module, _BatchNormBase):
        out = _convert_one(module, process_group)
    for name, child in list(module.named_children()):
        new_child = convert_sync_batchnorm(child, process_group)
        if new_child is not child or out is not module:
            out.add_module(name, new_child)
    return out


def _convert_one(bn: _BatchNormBase, process_group: Any) -> SyncBatchNorm:
    """A ``SyncBatchNorm`` built on the meta device that then takes over ``bn``'s own tensors and flags."""
    new = SyncBatchNorm(
        bn.num_features,
        eps=bn.eps,
        momentum=bn.momentum,
        affine=bn.affine,
        track_running_stats=bn.track_running_stats,
        process_group=process_group,
        device="meta",
        bias=cast("torch.Tensor | None", bn.bias) is not None or not bn.affine,
        sync_timeout=getattr(bn, "sync_timeout", DEFAULT_SYNC_TIMEOUT),
    )
    take_over_state(new, bn, "convert_sync_batchnorm")
    return new
