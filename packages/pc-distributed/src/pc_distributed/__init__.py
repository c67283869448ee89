"""pc-distributed: World, CollectiveGroup, RpcGroup, run_world, DataParallel and DASO on torch.distributed."""

from pc_distributed.__about__ import __version__
from pc_distributed._errors import RankDiedError, RemoteTraceback
from pc_distributed.collective import CollectiveGroup, RecvHandle
from pc_distributed.daso import DASO
from pc_distributed.data_parallel import DataParallel
from pc_distributed.data_parallel_multigpu import DataParallelMultiGPU
from pc_distributed.dp_optimizer import DataParallelOptimizer
from pc_distributed.launcher import run_world
from pc_distributed.remote_ref import RemoteRef
from pc_distributed.rpc_group import RpcGroup
from pc_distributed.world import World, get_cur_name, get_cur_rank, get_world, is_world_initialized

__all__ = [
    "DASO",
    "CollectiveGroup",
    "DataParallel",
    "DataParallelMultiGPU",
    "DataParallelOptimizer",
    "RankDiedError",
    "RecvHandle",
    "RemoteRef",
    "RemoteTraceback",
    "RpcGroup",
    "World",
    "__version__",
    "get_cur_name",
    "get_cur_rank",
    "get_world",
    "is_world_initialized",
    "run_world",
]
