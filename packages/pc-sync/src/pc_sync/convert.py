"""``convert_model``: swap every torch batch norm of a model for its synchronized twin, keeping its state."""

from __future__ import annotations

import logging
from typing import Any, cast

import torch
from torch import nn

from pc_sync.replica_batchnorm import (
    SynchronizedBatchNorm1d,
    SynchronizedBatchNorm2d,
    SynchronizedBatchNorm3d,
    take_over_state,
)

__all__ = ["convert_model"]

logger = logging.getLogger(__name__)

_SYNC_CLASS: dict[type[nn.Module], type[nn.Module]] = {
    nn.BatchNorm1d: SynchronizedBatchNorm1d,
    nn.BatchNorm2d: SynchronizedBatchNorm2d,
    nn.BatchNorm3d: SynchronizedBatchNorm3d,
}
_LAZY_BN = (nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d)


def convert_model(module: nn.Module) -> nn.Module:
    """Replace every ``nn.BatchNorm1d/2d/3d`` in ``module`` (itself included) by its synchronized twin.

    Each replacement takes over **the same** Parameter and buffer objects (``num_batches_tracked`` included),
    the training flag and the hyper-parameters (``eps``, ``momentum``, ``affine``, ``track_running_stats``),
    so the device, the dtype and any optimizer built on the old parameters stay valid. Submodules are replaced
    in place on their parents; modules that are already synchronized, ``nn.SyncBatchNorm`` and subclasses of
    the batch-norm classes (whose overrides would be lost) are left alone.

    A ``torch.nn.DataParallel`` comes back as ``pc_replicate.ReplicationCallbackDataParallel`` with the same
    ``device_ids``, ``output_device`` and ``dim``, so the synchronized modules see their replicas.

    Args:
        module: The model to convert.

    Returns:
        The converted model: ``module`` itself unless it is a batch norm or a ``DataParallel``.

    Raises:
        TypeError: If ``module`` is not an ``nn.Module``.
        ValueError: If the model holds an uninitialized lazy batch norm (run one forward first).
        ImportError: If ``module`` is a ``DataParallel`` and pc-replicate is not installed.

    Examples:
        >>> import torch
        >>> net = convert_model(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4)))
        >>> type(net[1]).__name__
        'SynchronizedBatchNorm2d'
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"convert_model expects a torch.nn.Module, got {type(module).__name__}")
    if isinstance(module, nn.DataParallel):
        return _convert_data_parallel(module)
    return _convert_tree(module)


def _convert_tree(module: nn.Module) -> nn.Module:
    if isinstance(module, _LAZY_BN):
        raise ValueError(
            f"cannot convert an uninitialized {type(module).__name__}: run one forward to initialize it first"
        )
    sync_cls = _SYNC_CLASS.get(type(module))
    if sync_cls is not None:
        return _convert_bn(module, sync_cls)
    for name, child in list(module.named_children()):
        new_child = _convert_tree(child)
        if new_child is not child:
            setattr(module, name, new_child)
    return module


def _convert_bn(bn: nn.Module, sync_cls: type[nn.Module]) -> nn.Module:
    """Build ``sync_cls`` on the meta device, then hand it the old module's own tensors and flags."""
    new = sync_cls(
        bn.num_features,
        eps=bn.eps,
        momentum=bn.momentum,
        affine=bn.affine,
        track_running_stats=bn.track_running_stats,
        device="meta",
        bias=cast("torch.Tensor | None", bn.bias) is not None or not bn.affine,
    )
    take_over_state(new, bn, "convert_model")
    return new


def _convert_data_parallel(dp: nn.DataParallel[Any]) -> nn.Module:
    try:
        from pc_replicate import ReplicationCallbackDataParallel
    except ImportError as exc:
        raise ImportError(
            "convert_model(torch.nn.DataParallel) returns a pc_replicate.ReplicationCallbackDataParallel so "
            "that the synchronized batch norms see their replicas; install it: pip install pc-replicate"
        ) from exc
    inner = _convert_tree(dp.module)
    if isinstance(dp, ReplicationCallbackDataParallel):
        dp.module = inner
        return dp
    device_ids = getattr(dp, "device_ids", None) or None
    output_device = getattr(dp, "output_device", None)
    dim = getattr(dp, "dim", 0)
    logger.debug("convert_model: DataParallel -> ReplicationCallbackDataParallel(device_ids=%r)", device_ids)
    return ReplicationCallbackDataParallel(inner, device_ids=device_ids, output_device=output_device, dim=dim)
