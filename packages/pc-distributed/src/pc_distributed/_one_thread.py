"""A guard for the calls that must be issued by one thread of a process at a time.

Collectives of one process group must be issued in the same order on every rank; two threads of a process
issuing them at once would do so in an order that differs between ranks, and the ranks would then exchange the
wrong tensors or wait for each other forever. The same holds for a group's barrier generations and for the
numbering of collective groups. Such an object holds a :class:`OneThreadAtATime` and wraps each of those calls
in it: a call made while another thread of the process is inside one raises ``RuntimeError`` naming both
threads, instead of corrupting the order. Calls from different threads one after the other are fine, and a
thread may nest calls (a collective issued from inside another of the same object's guarded calls).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["OneThreadAtATime"]


class OneThreadAtATime:
    """Refuses a guarded call while another thread of this process is inside a guarded call of the same owner.

    Args:
        what: Names the owner in the error (e.g. ``"collective group [0, 1]"``).
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread inside, by ident
        self._owner_name = ""
        self._owner_call = ""
        self._depth = 0

    @contextmanager
    def __call__(self, call: str) -> Iterator[None]:
        """Hold the owner for ``call``; raise at once if another thread holds it.

        Raises:
            RuntimeError: Another thread of this process is inside one of the owner's guarded calls.
        """
        me = threading.get_ident()
        with self._lock:
            if self._owner is not None and self._owner != me:
                raise RuntimeError(
                    f"{self.what}: {call}() called from thread {threading.current_thread().name!r} while "
                    f"thread {self._owner_name!r} is inside {self._owner_call}(); these calls must be issued "
                    "by one thread at a time, in the same order on every rank"
                )
            if self._owner is None:
                self._owner, self._owner_name, self._owner_call = me, threading.current_thread().name, call
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._owner = None
