"""The pool's waits and threads that keep Ctrl-C working (CPython runs signal handlers in the main thread)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

from pc_pool._settings import SIGNAL_SLICE, TICK, now

__all__ = ["start_with_sigint_blocked", "wait_in_slices"]


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
