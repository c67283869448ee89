"""Process and thread pools for PyTorch that run lambdas, share tensors and never hang."""

# First: it imports torch with torch's "Failed to initialize NumPy" warning ignored (pc-pool needs no numpy).
from pc_pool import _quiet  # isort: skip  # noqa: F401
from pc_pool.__about__ import __version__
from pc_pool.base_pool import BasePool, PoolStates
from pc_pool.errors import PoolTerminatedError, RemoteTraceback, WorkerDiedError
from pc_pool.process_pools import CtxPool, P2PPool, Pool
from pc_pool.queue import MultiP2PQueue, SimpleP2PQueue, SimpleQueue
from pc_pool.results import AsyncResult, IMapIterator, IMapUnorderedIterator, MapResult
from pc_pool.thread_pool import CtxThreadPool, ThreadPool
from pc_pool.worker import CtxPoolStorage, proxy_ctx_caller

__all__ = [
    "AsyncResult",
    "BasePool",
    "CtxPool",
    "CtxPoolStorage",
    "CtxThreadPool",
    "IMapIterator",
    "IMapUnorderedIterator",
    "MapResult",
    "MultiP2PQueue",
    "P2PPool",
    "Pool",
    "PoolStates",
    "PoolTerminatedError",
    "RemoteTraceback",
    "SimpleP2PQueue",
    "SimpleQueue",
    "ThreadPool",
    "WorkerDiedError",
    "__version__",
    "proxy_ctx_caller",
]
