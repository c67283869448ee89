"""DASO: node-local DistributedDataParallel with skipped, stale, downcast global synchronisation.

Public: :class:`DASO` (``daso.py``) and :class:`DataParallelMultiGPU` (``multigpu.py``), the node-local
wrapper DASO drives. The underscored modules are the pure skip schedule (``_schedule``), the node and column
groups (``_topology``) and the global exchange with its stale merge (``_exchange``).
"""

from pc_distributed.parallel.daso.daso import DASO
from pc_distributed.parallel.daso.multigpu import DataParallelMultiGPU

__all__ = ["DASO", "DataParallelMultiGPU"]
