"""DASO's global exchange: the parameters' drift sent over the column group, and the staleness-weighted merge.

An exchange starts on the node's sender (``send_mod``): ``downcast(p - p_ref)`` is all-reduced in chunks,
asynchronously, over the column group (one rank per node). It completes ``S`` batches later: the sum is
restored in float32 as ``sum(delta) + P * p_ref``, merged with :func:`staleness_merge`, and broadcast inside
the node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pc_distributed.parallel._comm import broadcast_tensors, wait_work
from pc_distributed.parallel.daso._topology import DasoTopology

__all__ = ["Exchange", "complete_exchange", "flatten", "staleness_merge"]


@dataclass
class Exchange:
    """One global exchange in flight: due at batch ``due``, sent by the node's local rank ``sender``."""

    due: int
    staleness: int
    sender: int
    payload: torch.Tensor | None = None
    works: list[Any] = field(default_factory=list)

    def send(self, payload: torch.Tensor, group: Any, chunk_size: int) -> None:
        """Post the asynchronous all-reduces of ``payload`` over ``group``, ``chunk_size`` elements each."""
        self.payload = payload
        for chunk in torch.split(payload, chunk_size):
            self.works.append(dist.all_reduce(chunk, group=group, async_op=True))


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """All ``tensors`` as one flat float32 tensor (a copy)."""
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def complete_exchange(
    exchange: Exchange, tensors: list[torch.Tensor], ref: torch.Tensor, topology: DasoTopology, timeout: Any
) -> torch.Tensor | None:
    """Wait for ``exchange`` (within ``timeout``), merge it into ``tensors`` and broadcast them in the node.

    Returns:
        The new reference parameters after a blocking average (staleness 0), else None.
    """
    if exchange.payload is not None:
        for work in exchange.works:
            wait_work(work, timeout)
        nodes = topology.nodes
        total = exchange.payload.to(torch.float32) + nodes * ref
        merged = staleness_merge(flatten(tensors), total, exchange.staleness, nodes)
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(merged[offset : offset + n].view_as(t))
            offset += n
    broadcast_tensors(tensors, topology.local_group, src_group_rank=exchange.sender)
    return flatten(tensors) if exchange.staleness == 0 else None


def staleness_merge(local: torch.Tensor, total: torch.Tensor, staleness: int, nodes: int) -> torch.Tensor:
    """DASO's merge of stale global sums into the current local parameters.

    ``(2S * local + total) / (2S + P)``: the sum over the ``P`` nodes of parameters sent ``S`` batches ago is
    weighted against the local parameters, which are worth ``2S`` nodes' data. ``S = 0`` is the plain average.

    Args:
        local: This rank's current parameters (float32).
        total: The sum over nodes of the parameters that were sent (float32).
        staleness: ``S``, batches between sending and merging.
        nodes: ``P``, the number of nodes.

    Returns:
        The merged parameters.

    Examples:
        >>> staleness_merge(torch.tensor([1.0]), torch.tensor([4.0]), staleness=1, nodes=2)
        tensor([1.5000])
    """
    weight = 2.0 * staleness
    return (weight * local + total) / (weight + nodes)
