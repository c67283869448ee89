"""Constants and small helpers of the process pool engine (see the diagram in :mod:`pc_pool.pool`).

The state the pool's threads share lives in :class:`pc_pool._state.EngineState`; this module holds what has
no state: the window and grace constants, argument checks, the SIGINT mask of pool threads, the main thread's
signal-aware waits and the registry of live pools that interpreter exit terminates.
"""

from __future__ import annotations

import atexit
import enum
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from pc_pool._checks import positive_int

__all__ = [
    "CLOSE_GRACE",
    "FAST_RTT",
    "KILL_GRACE",
    "MAX_WINDOW",
    "NO_CONTEXT",
    "SIGNAL_SLICE",
    "TICK",
    "WINDOW",
    "PoolStates",
    "check_pool_args",
    "now",
    "register_pool",
    "start_with_sigint_blocked",
    "unregister_pool",
    "wait_in_slices",
]

_log = logging.getLogger(__name__)
WINDOW = 2  # chunks outstanding per worker: one running, one waiting in the pipe
# A worker that answers fast gets a deeper window: as many chunks as it runs in about FAST_RTT seconds (by the
# moving average of its service time), up to MAX_WINDOW. Tiny tasks then never wait for the parent's round
# trip (or for a scheduler delay on a loaded machine), and a slow task holds back at most ~FAST_RTT of fast
# ones. The feeder refills once half the window is left, so it wakes and writes once per half window.
FAST_RTT = 0.002
MAX_WINDOW = 32
KILL_GRACE = 1.0  # seconds between SIGTERM and SIGKILL in terminate()
CLOSE_GRACE = 5.0  # seconds a worker gets to exit after a drained close() before it is killed
TICK = 5.0  # upper bound of any internal wait; predicates are re-checked, nothing relies on it
SIGNAL_SLICE = 0.5  # longest wait of the main thread between two looks at pending signals (wait_in_slices)
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
    positive_int("processes", processes)
    if initializer is not None and not callable(initializer):
        raise TypeError(f"initializer must be callable or None, got {type(initializer).__name__}")
    return processes


def start_with_sigint_blocked(thread: threading.Thread) -> None:
    """Start a pool-owned ``thread`` with SIGINT blocked from its first instruction.

    The kernel delivers a process-directed SIGINT to any thread that does not block it. If it lands in a pool
    thread, Python only sets a flag there, and a main thread blocked in ``Event.wait(timeout)`` (``get()``)
    does not see the Ctrl-C until its timeout ends. A thread inherits its creator's signal mask, so the mask
    is set in the calling thread around ``start()`` and restored after: blocking inside the new thread would
    leave a window, before it runs, in which a Ctrl-C could still land there. A Ctrl-C that arrives in the
    caller meanwhile stays pending and is delivered when the mask is restored. Processes forked from such a
    thread inherit the mask too.
    """
    if not hasattr(signal, "pthread_sigmask"):
        thread.start()
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def wait_in_slices(wait: Callable[[float], bool], timeout: float | None) -> bool:
    """Call ``wait(seconds)`` until it returns true or ``timeout`` seconds pass (``None``: no limit).

    Returns:
        The last answer of ``wait``: true when the awaited condition holds, false when ``timeout`` ran out.

    CPython runs signal handlers in the main thread only, between two bytecodes. A Ctrl-C whose handler runs
    after the interpreter's last look at pending signals but before a lock, condition or ``select`` wait
    enters the kernel (or whose handler runs in another thread) does not end that wait: the
    ``KeyboardInterrupt`` would stay pending until the wait's own timeout, an hour or never. So the main
    thread calls ``wait`` for at most :data:`SIGNAL_SLICE` seconds at a time, and a pending Ctrl-C is raised
    between two slices; other threads never run handlers and wait up to :data:`TICK` at a time.
    """
    step = SIGNAL_SLICE if threading.current_thread() is threading.main_thread() else TICK
    deadline = None if timeout is None else now() + timeout
    while True:
        if wait(step if deadline is None else max(0.0, min(step, deadline - now()))):
            return True
        if deadline is not None and now() >= deadline:
            return False


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
