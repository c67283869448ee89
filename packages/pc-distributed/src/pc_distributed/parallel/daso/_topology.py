"""DASO's process topology: node-local groups and the per-local-rank "column" groups across nodes.

With G processes per node and N nodes (consecutive blocks of G global ranks form a node)::

    node 0: ranks 0 .. G-1      local group of node n  = {nG, ..., nG+G-1}     (node-local DDP)
    node 1: ranks G .. 2G-1     column group of index j = {j, G+j, 2G+j, ...}  (global exchange, one per j)

Every rank creates every group, in the same order (torch's ``new_group`` rule), through
``torch.distributed.new_subgroups_by_enumeration``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["DasoTopology", "build_topology", "default_local_size"]


@dataclass(frozen=True)
class DasoTopology:
    """Where this process sits in DASO's node-by-local-rank grid."""

    world_size: int
    local_size: int
    node: int
    local_rank: int
    local_group: dist.ProcessGroup
    column_group: dist.ProcessGroup

    @property
    def nodes(self) -> int:
        """The number of (possibly simulated) nodes."""
        return self.world_size // self.local_size


def default_local_size() -> int:
    """Processes per node: ``LOCAL_WORLD_SIZE`` (torchrun), else CUDA device count, else world size."""
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env:
        return int(env)
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return int(torch.cuda.device_count())
    return int(dist.get_world_size())


def build_topology(local_size: int, device: torch.device, timeout: timedelta | None) -> DasoTopology:
    """Create the local and column groups (collective over the default group).

    Args:
        local_size: Processes per node; must be equal on every rank and divide the world size.
        device: The device collectives run on (for the consistency check).
        timeout: Timeout of the new groups, or ``None`` for the default.

    Returns:
        This process's topology.

    Raises:
        ValueError: If ``local_size`` differs across ranks or does not divide the world size (on every rank).
    """
    world = int(dist.get_world_size())
    rank = int(dist.get_rank())
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([local_size], dtype=torch.int64, device=device))
    seen = [int(s.item()) for s in sizes]
    if len(set(seen)) != 1:
        raise ValueError(f"local_size (processes per node) must be equal on every rank, got {seen} by rank")
    if local_size < 1 or world % local_size != 0:
        raise ValueError(f"local_size must be >= 1 and divide the world size {world}, got {local_size}")
    nodes = world // local_size
    node_lists = [list(range(n * local_size, (n + 1) * local_size)) for n in range(nodes)]
    column_lists = [list(range(j, world, local_size)) for j in range(local_size)]
    local_group, _ = dist.new_subgroups_by_enumeration(node_lists, timeout=timeout)  # type: ignore[no-untyped-call]
    column_group, _ = dist.new_subgroups_by_enumeration(column_lists, timeout=timeout)  # type: ignore[no-untyped-call]
    if local_group is None or column_group is None:  # pragma: no cover - every rank is in one of each
        raise RuntimeError(f"rank {rank} was not placed in a DASO group")
    return DasoTopology(world, local_size, rank // local_size, rank % local_size, local_group, column_group)
