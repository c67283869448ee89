"""DataParallel with replication callbacks, CPU thread replicas, and a threaded Parallel."""

from pc_replicate.__about__ import __version__
from pc_replicate.callback import CallbackContext, exec_data_parallel_replication_callback
from pc_replicate.data_parallel import (
    DataParallelWithCallback,
    ReplicationCallbackDataParallel,
    patch_replication_callback,
)
from pc_replicate.parallel import Parallel, Parallelizable

__all__ = [
    "CallbackContext",
    "DataParallelWithCallback",
    "Parallel",
    "Parallelizable",
    "ReplicationCallbackDataParallel",
    "__version__",
    "exec_data_parallel_replication_callback",
    "patch_replication_callback",
]
