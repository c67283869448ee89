"""``DataParallelMultiGPU``: ``DistributedDataParallel`` in each (maybe simulated) node, driven by DASO."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pc_distributed.parallel._comm import CommLike, broadcast_tensors, check_replicas, resolve_group
from pc_distributed.parallel.daso.daso import DASO

__all__ = ["DataParallelMultiGPU"]


class DataParallelMultiGPU(nn.Module):
    """Node-local data parallelism for :class:`~pc_distributed.DASO`.

    At construction the replicas are made identical by broadcasting parameters and buffers from global rank 0
    (so pretrained weights survive), then the module is wrapped in
    ``DistributedDataParallel`` over DASO's node-local group. It does no global synchronisation itself: DASO's
    :meth:`~pc_distributed.DASO.step` does. On batches where DASO skips the local synchronisation, the forward
    runs under ``DistributedDataParallel.no_sync()``.

    Args:
        module: The local model (on the device this process trains on).
        optimizer: The :class:`~pc_distributed.DASO` instance, built before this wrapper.
        comm: The global group: ``None``, a ``ProcessGroup`` or ``CollectiveGroup`` spanning the world (as
            DASO's).

    Raises:
        TypeError: If ``module`` is not a module or ``optimizer`` not a DASO.
        ValueError: If the module has no parameters or the models differ across ranks (on every rank).
    """

    def __init__(self, module: nn.Module, optimizer: DASO, comm: CommLike = None) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if not isinstance(optimizer, DASO):
            raise TypeError(f"optimizer must be a pc_distributed.DASO, got {type(optimizer).__name__}")
        group = resolve_group(comm)
        tensors = [*module.parameters(), *module.buffers()]
        device = tensors[0].device if tensors else torch.device("cpu")
        error = None
        if not any(p.requires_grad for p in module.parameters()):
            error = ValueError(
                "the module has no trainable parameters (requires_grad=True); nothing to train"
            )
        check_replicas(module, group, device, error)
        broadcast_tensors(tensors, group)
        device_ids = [device] if device.type == "cuda" else None
        self.module = DistributedDataParallel(
            module, device_ids=device_ids, process_group=optimizer.local_group
        )
        self.comm = comm
        self.optimizer = optimizer
        optimizer.set_model(module)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the DDP-wrapped module, without the node-local gradient sync on batches DASO skips.

        Args:
            *inputs: Positional inputs of the wrapped module.
            **kwargs: Keyword inputs of the wrapped module.

        Returns:
            The module's output.
        """
        if self.optimizer.local_sync_due():
            return self.module(*inputs, **kwargs)
        with self.module.no_sync():
            return self.module(*inputs, **kwargs)
