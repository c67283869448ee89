"""Data parallelism on torch.distributed process groups: DataParallel, its optimizer, and DASO.

Public: :class:`DataParallel` (``data_parallel.py``), :class:`DataParallelOptimizer` (``optimizer.py``) and,
from the ``daso`` subpackage, :class:`DASO` and :class:`DataParallelMultiGPU`; from the ``elastic``
subpackage, :class:`ElasticDataParallel` (members may die or join), :class:`ElasticSampler`,
:class:`StepContext` and :class:`QuorumEntry`. The underscored modules are the
gradient buckets (``_buckets``) and the collectives the wrappers issue on a group (``_comm``). Nothing here
imports the World, RPC or collective groups: a wrapper takes a process group (or anything holding one).
"""

from pc_distributed.parallel.daso import DASO, DataParallelMultiGPU
from pc_distributed.parallel.data_parallel import DataParallel
from pc_distributed.parallel.elastic import ElasticDataParallel, ElasticSampler, QuorumEntry, StepContext
from pc_distributed.parallel.optimizer import DataParallelOptimizer

__all__ = [
    "DASO",
    "DataParallel",
    "DataParallelMultiGPU",
    "DataParallelOptimizer",
    "ElasticDataParallel",
    "ElasticSampler",
    "QuorumEntry",
    "StepContext",
]
