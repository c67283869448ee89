"""Shared state and helpers of the process pool engine (see the diagram in :mod:`pc_pool.pool`).

:class:`EngineState` declares what the feeder threads (:mod:`pc_pool._feeder`), the result thread
(:mod:`pc_pool._collector`) and :class:`~pc_pool.BasePool` share, and holds the helpers they all use: failing
everything, breaking the pool, waking the result thread and putting chunks back. Every field is guarded by
``_cond`` unless noted.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import enum
import logging
import multiprocessing.context
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from pc_pool._records import Chunk, Job, WorkerHandle
from pc_pool.errors import PoolTerminatedError

__all__ = [
    "CLOSE_GRACE",
    "FAST_RTT",
    "FAST_WINDOW",
    "KILL_GRACE",
    "NO_CONTEXT",
    "TICK",
    "WINDOW",
    "EngineState",
    "PoolStates",
    "block_sigint_in_this_thread",
    "check_pool_args",
    "now",
    "register_pool",
    "unregister_pool",
]

_log = logging.getLogger("pc_pool.pool")
WINDOW = 2  # chunks outstanding per worker: one running, one waiting in the pipe
# While a worker answers within FAST_RTT seconds, its feeder may keep FAST_WINDOW chunks outstanding: tiny
# tasks then never wait for the parent's round trip, and a slow task can hold back at most a few fast ones.
FAST_WINDOW = 4
FAST_RTT = 0.002
KILL_GRACE = 1.0  # seconds between SIGTERM and SIGKILL in terminate()
CLOSE_GRACE = 5.0  # seconds a worker gets to exit after a drained close() before it is killed
TICK = 5.0  # upper bound of any internal wait; predicates are re-checked, nothing relies on it
NO_CONTEXT = object()
now = time.monotonic

_live_pools: weakref.WeakSet[Any] = weakref.WeakSet()
_atexit_registered = False
_atexit_lock = threading.Lock()


def _terminate_live_pools() -> None:
    for pool in list(_live_pools):
        try:
            pool.terminate()
        except Exception:  # pragma: no cover - best effort at interpreter exit
            _log.debug("terminating a pool at exit failed", exc_info=True)


def check_pool_args(processes: int | None, initializer: Callable[..., object] | None) -> int:
    """Validate the arguments every pool shares; return the number of workers (``None``: the CPU count).

    Raises:
        TypeError: ``processes`` is not an int (or None), or ``initializer`` is not callable (or None).
        ValueError: ``processes`` is below 1.
    """
    if processes is None:
        processes = os.cpu_count() or 1
    if isinstance(processes, bool) or not isinstance(processes, int):
        raise TypeError(f"processes must be an int or None, got {type(processes).__name__}")
    if processes < 1:
        raise ValueError(f"processes must be at least 1, got {processes}")
    if initializer is not None and not callable(initializer):
        raise TypeError(f"initializer must be callable or None, got {type(initializer).__name__}")
    return processes


def block_sigint_in_this_thread() -> None:
    """Block SIGINT in the calling (pool-owned) thread.

    The kernel delivers a process-directed SIGINT to any thread that does not block it. If it lands in a pool
    thread, Python only sets a flag there, and a main thread blocked in ``Event.wait(timeout)`` (``get()``)
    does not see the Ctrl-C until its timeout ends. Blocking SIGINT in every thread the pool owns makes the
    kernel pick the main thread, whose wait is then interrupted at once. Threads started from here (and
    processes forked from here) inherit the mask.
    """
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def register_pool(pool: Any) -> None:
    """Track a live pool so that interpreter exit terminates it (the atexit hook is installed lazily)."""
    global _atexit_registered
    with _atexit_lock:
        if not _atexit_registered:
            atexit.register(_terminate_live_pools)
            _atexit_registered = True
        _live_pools.add(pool)


def unregister_pool(pool: Any) -> None:
    """Stop tracking a pool that has shut down."""
    _live_pools.discard(pool)


class PoolStates(enum.Enum):
    """Lifecycle states of a pool."""

    RUN = 0
    CLOSE = 1
    TERMINATE = 2


class EngineState:
    """The fields and helpers shared by the pool's threads (a mixin of :class:`~pc_pool.BasePool`)."""

    _processes: int
    _initializer: Callable[..., object] | None
    _initargs: tuple[Any, ...]
    _maxtasksperchild: int | None
    _ctx: multiprocessing.context.BaseContext
    _state: PoolStates
    _cond: threading.Condition
    _cache: dict[int, Any]
    _jobs: dict[int, Job]
    _workers: list[WorkerHandle | None]
    _ready: collections.deque[Chunk]
    _slot_ready: list[collections.deque[Chunk]]
    _stopping: bool
    _broken: BaseException | None
    _close_deadline: float | None
    _started: threading.Event
    _start_error: BaseException | None
    _wake_r: int
    _wake_w: int
    _wake_lock: threading.Lock
    _copy_tensor: bool = True
    _recurse: bool = False
    _daemon: bool = True
    _p2p: bool = False

    # -- hooks implemented by BasePool ----------------------------------------------------------------------
    def pool_inqueue_put(self, obj: Any) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def pool_outqueue_get(self, timeout: float) -> list[tuple[int, Any]]:  # pragma: no cover - abstract
        raise NotImplementedError

    def repopulate_pool(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def maintain_pool(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def terminate_workers(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def join_workers(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    @staticmethod
    def worker(*args: Any, **kwargs: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _deliver(self, chunk: Chunk, success: bool, value: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _worker_context(self, index: int) -> Any:
        """The context object of worker ``index`` (``CtxPool``); the base pool has none."""
        return NO_CONTEXT

    # -- shared helpers -------------------------------------------------------------------------------------
    def _fail_everything(self, exc: BaseException) -> None:
        with self._cond:
            self._state = PoolStates.TERMINATE
            self._stopping = True
            jobs = list(self._jobs.values())
            self._jobs.clear()
            self._ready.clear()
            for dq in self._slot_ready:
                dq.clear()
            self._cond.notify_all()
        for job in jobs:
            err = type(exc)(*exc.args)
            err.__cause__ = exc.__cause__
            job.result._fail(err)

    def _break(self, cause: BaseException) -> None:
        """A worker could not initialize: move to TERMINATE with that cause (no respawn loop)."""
        _log.error("pc_pool worker failed to initialize; terminating the pool: %r", cause)
        self._broken = cause
        err = PoolTerminatedError(f"the pool broke: a worker failed to initialize ({cause!r})")
        err.__cause__ = cause
        self._fail_everything(err)

    def _wake(self) -> None:
        # A full pipe already wakes the thread; after shutdown there is nobody to wake.
        with self._wake_lock, contextlib.suppress(BlockingIOError, OSError):
            if self._wake_w >= 0:
                os.write(self._wake_w, b"\0")

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _wants_workers(self) -> bool:
        if self._stopping or self._state is PoolStates.TERMINATE:
            return False
        return self._state is PoolStates.RUN or bool(self._jobs)

    def _requeue(self, chunks: Iterable[Chunk]) -> None:
        """Put chunks back at the front, in their order (caller holds ``_cond``)."""
        for chunk in reversed(list(chunks)):
            chunk.sent = False
            if chunk.job.id not in self._jobs:
                continue
            (self._slot_ready[chunk.slot] if chunk.slot is not None else self._ready).appendleft(chunk)
        self._cond.notify_all()
