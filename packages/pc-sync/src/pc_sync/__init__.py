"""SyncMaster/SlavePipe, and batch norm synchronized across DataParallel replicas and across processes."""

from pc_sync.__about__ import __version__
from pc_sync.comm import FutureResult, SlavePipe, SyncMaster
from pc_sync.convert import convert_model
from pc_sync.errors import DEFAULT_SYNC_TIMEOUT, SyncAbortedError, SyncError, SyncTimeoutError
from pc_sync.process_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from pc_sync.replica_batchnorm import (
    SynchronizedBatchNorm1d,
    SynchronizedBatchNorm2d,
    SynchronizedBatchNorm3d,
)

__all__ = [
    "DEFAULT_SYNC_TIMEOUT",
    "FutureResult",
    "SlavePipe",
    "SyncAbortedError",
    "SyncBatchNorm",
    "SyncError",
    "SyncMaster",
    "SyncTimeoutError",
    "SynchronizedBatchNorm1d",
    "SynchronizedBatchNorm2d",
    "SynchronizedBatchNorm3d",
    "__version__",
    "convert_model",
    "convert_sync_batchnorm",
]
