"""The process pool engine's settings: windows, graces and ticks, its states, the checks every pool shares.

The engine itself is :mod:`pc_pool.base_pool` (its diagram); the state its threads share is
:class:`pc_pool._state.EngineState`. What waits on signals is :mod:`pc_pool._signals`; the registry of live
pools that interpreter exit terminates is :mod:`pc_pool._live_pools`.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Callable

from pc_pool._checks import positive_int

__all__ = [
    "CLOSE_GRACE",
    "FAST_RTT",
    "KILL_GRACE",
    "MAX_WINDOW",
    "NO_CONTEXT",
    "SIGNAL_SLICE",
    "TERM_REPEAT",
    "TICK",
    "WINDOW",
    "PoolStates",
    "check_pool_args",
    "now",
]

WINDOW = 2  # chunks outstanding per worker: one running, one waiting in the pipe
# A worker that answers fast gets a deeper window: as many chunks as it runs in about FAST_RTT seconds (by the
# moving average of its service time), up to MAX_WINDOW. Tiny tasks then never wait for the parent's round
# trip (or for a scheduler delay on a loaded machine), and a slow task holds back at most ~FAST_RTT of fast
# ones. The feeder refills once half the window is left, so it wakes and writes once per half window.
FAST_RTT = 0.002
MAX_WINDOW = 32
KILL_GRACE = 1.0  # seconds between SIGTERM and SIGKILL in terminate()
# SIGTERM is sent again this often during KILL_GRACE. Python runs a signal handler between bytecodes, so a
# SIGTERM that lands after the last check and before a blocking call (time.sleep, a pipe read) only trips a
# flag and the call blocks on; the next SIGTERM interrupts it and the handler runs. The worker's handler acts
# on the first one it runs for and ignores the rest.
TERM_REPEAT = 0.05
CLOSE_GRACE = 5.0  # seconds a worker gets to exit after a drained close() before it is killed
TICK = 5.0  # upper bound of any internal wait; predicates are re-checked, nothing relies on it
SIGNAL_SLICE = 0.5  # longest wait of the main thread between two looks at pending signals (wait_in_slices)
NO_CONTEXT = object()
now = time.monotonic


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


class PoolStates(enum.Enum):
    """Lifecycle states of a pool."""

    RUN = 0
    CLOSE = 1
    TERMINATE = 2
