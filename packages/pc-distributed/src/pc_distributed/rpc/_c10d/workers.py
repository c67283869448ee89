"""The c10d transport's thread plumbing: a small pool of daemon threads, and the sentinel that ends them.

The transport runs requests on a :class:`Workers` pool (and completes the futures of non-blocking calls on a
second one); its lanes, receivers and housekeeper are queue-fed threads that :data:`STOP` ends.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["STOP", "Workers"]

logger = logging.getLogger(__name__)

STOP = object()
"""The sentinel that ends a queue-fed thread (a worker, a lane, an idle receiver, the housekeeper)."""


class Workers:
    """Up to ``size`` daemon threads running submitted callables, started when needed.

    Each submitted callable either claims an idle thread or starts a new one (up to ``size``), so a callable
    never waits behind a running one while fewer than ``size`` run. Daemon threads: a handler that never
    returns must not keep the interpreter from exiting.
    """

    def __init__(self, size: int, name: str) -> None:
        self._size = size
        self._name = name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._stopped = False

    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on an idle thread, or on a new one while fewer than ``size`` run (else it queues).

        Raises:
            RuntimeError: The pool is stopped.
        """
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"{self._name} is stopped")
            if self._idle > 0:
                self._idle -= 1
            elif len(self._threads) < self._size:
                thread = threading.Thread(
                    target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
            self._queue.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._queue.get()  # woken by a callable or by stop()'s sentinel
            if fn is STOP:
                return
            try:
                fn()
            except Exception:  # pragma: no cover - the submitted callables catch their own errors
                logger.exception("%s: an internal task failed", self._name)
            del fn  # what it holds (a request's arguments) is not kept alive while this thread is idle
            with self._lock:
                self._idle += 1

    def stop(self, deadline: float) -> list[str]:
        """End the threads after their current callable; the names of those still running at ``deadline``.

        Called from one of the pool's own threads (a callable that stops the pool), it does not wait for that
        thread, which ends once the callable returns.
        """
        with self._lock:
            self._stopped = True
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(STOP)
        others = [t for t in threads if t is not threading.current_thread()]
        for thread in others:
            thread.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in others if t.is_alive()]
