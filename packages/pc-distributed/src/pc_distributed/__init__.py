"""pc-distributed: World, CollectiveGroup, RpcGroup, run_world, DataParallel and DASO on torch.distributed.

Subpackages by concern, each re-exported here: ``world`` (the World and ``run_world``), ``rpc`` (RpcGroup,
RemoteRef), ``collective`` (CollectiveGroup), ``parallel`` (DataParallel and its optimizer),
``parallel.daso`` (DASO) and ``parallel.elastic`` (ElasticDataParallel). The underscored modules at this
level are the layer under all of them: the torch-facing calls for process groups, pair links and RPC
(``_torch_dist``), the store layer (``_store``, a subpackage with its own torch-facing module), argument
checks and the timeout convention (``_checks``), how torch's failures are read (``_torch_errors``), the
bound on calls torch may block in forever (``_bounded``), the World as the groups see it (``_host``), the
one-thread guard (``_one_thread``) and the remote-error types (``_errors``).
"""

from pc_distributed.__about__ import __version__
from pc_distributed._errors import RankDiedError, RemoteTraceback
from pc_distributed._store import EtcdStore
from pc_distributed.collective import CollectiveGroup, RecvHandle
from pc_distributed.parallel import (
    DASO,
    DataParallel,
    DataParallelMultiGPU,
    DataParallelOptimizer,
    ElasticDataParallel,
    ElasticSampler,
    QuorumEntry,
    StepContext,
)
from pc_distributed.rpc import RemoteRef, RpcGroup
from pc_distributed.world import World, get_cur_name, get_cur_rank, get_world, is_world_initialized, run_world

__all__ = [
    "DASO",
    "CollectiveGroup",
    "DataParallel",
    "DataParallelMultiGPU",
    "DataParallelOptimizer",
    "ElasticDataParallel",
    "ElasticSampler",
    "EtcdStore",
    "QuorumEntry",
    "RankDiedError",
    "RecvHandle",
    "RemoteRef",
    "RemoteTraceback",
    "RpcGroup",
    "StepContext",
    "World",
    "__version__",
    "get_cur_name",
    "get_cur_rank",
    "get_world",
    "is_world_initialized",
    "run_world",
]
