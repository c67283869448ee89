"""The C10d transport's bookkeeping: calls in flight, peers, handler threads, values kept for remote refs.

Kept apart from :mod:`pc_distributed.rpc._c10d_transport`, which holds the protocol (frames, sends, the
receiver, shutdown), so that the protocol reads without the plumbing it moves through.
"""

from __future__ import annotations

import heapq
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future as _Future
from dataclasses import dataclass, field
from typing import Any

from pc_distributed.rpc._c10d_codec import Encoded
from pc_distributed.rpc._c10d_frames import Incoming, Posted, Prediction

__all__ = ["STOP", "KeptValues", "Peer", "PendingCall", "PendingCalls", "Workers"]

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


@dataclass(eq=False)
class PendingCall:
    """A request sent and not answered yet: the future gets ``(reply kind, message or None)`` or an error."""

    peer: int
    call_id: int
    deadline: float
    timeout: float
    what: str
    future: _Future[tuple[int, Incoming | None]] = field(default_factory=_Future)
    decoded: tuple[int, Any] | None = None  # (reply kind, unpickled message), once read
    sent: tuple[Posted, Encoded | None] | None = (
        None  # the request's posted sends and message, until answered
    )
    decode_lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, exc: BaseException) -> None:
        """Complete with ``exc`` (by whoever removed the call from the pending table, under its lock)."""
        if not self.future.done():
            self.future.set_exception(exc)

    def answer(self, kind: int, message: Incoming | None) -> None:
        """Complete with a reply (same rule as :meth:`fail`)."""
        if not self.future.done():
            self.future.set_result((kind, message))


class PendingCalls:
    """The calls in flight, by call id, and their deadlines in order (a heap).

    Not locked by itself: the transport's lock guards it, together with the rest of the transport's state a
    call's end changes. A call's deadline stays in the heap when the call ends otherwise (its reply, a lost
    peer); such entries are dropped as they reach its top, so no one wakes for the deadline of a call that has
    ended (call ids are never reused, so an entry whose id is not pending is one of those).
    """

    def __init__(self) -> None:
        self._calls: dict[int, PendingCall] = {}
        self._deadlines: list[tuple[float, int]] = []  # (deadline, call id)

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, call: PendingCall) -> None:
        """Count ``call`` as in flight until it is popped."""
        self._calls[call.call_id] = call
        heapq.heappush(self._deadlines, (call.deadline, call.call_id))

    def get(self, call_id: int) -> PendingCall | None:
        """The call of ``call_id`` if it is still in flight."""
        return self._calls.get(call_id)

    def pop(self, call_id: int) -> PendingCall | None:
        """Remove the call of ``call_id`` and return it (None if it had ended: whoever popped it ends it)."""
        return self._calls.pop(call_id, None)

    def to(self, rank: int) -> list[PendingCall]:
        """The calls in flight to member ``rank``."""
        return [c for c in self._calls.values() if c.peer == rank]

    def pop_all(self) -> list[PendingCall]:
        """Remove every call in flight and return them."""
        calls = list(self._calls.values())
        self._calls.clear()
        self._deadlines.clear()
        return calls

    def next_deadline(self) -> float | None:
        """The earliest deadline of a call in flight, or None."""
        while self._deadlines and self._deadlines[0][1] not in self._calls:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def due(self, now: float) -> list[PendingCall]:
        """The calls in flight whose deadline is ``now`` or earlier (they stay in flight until popped)."""
        found = []
        while self._deadlines and self._deadlines[0][0] <= now:
            call = self._calls.get(heapq.heappop(self._deadlines)[1])
            if call is not None:
                found.append(call)
        return found


@dataclass(eq=False)
class Peer:
    """What this member knows about another: its lane, and whether frames may still go or come."""

    rank: int
    name: str
    link: Any  # the pair's process group
    link_rank: int  # the peer's rank in it
    post_lock: threading.Lock = field(default_factory=threading.Lock)  # frames are posted one at a time
    lane: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)  # sends the lane waits for
    lane_thread: threading.Thread | None = None
    receivers: list[threading.Thread] = field(default_factory=list)  # the two that take turns receiving
    turn: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)  # receiving handed on, or STOP
    waiting_turns: int = 0  # receiver threads waiting for the turn (under the transport's lock)
    receiver_done: threading.Event = field(default_factory=threading.Event)  # receiving from it has ended
    predicted: int | None = None  # the size it has posted ahead for our next parts (under post_lock)
    prediction: Prediction | None = None  # our receive posted ahead for its next parts (its receivers')
    said_bye: bool = False  # our goodbye is posted: nothing more goes to it (set under post_lock)
    heard_bye: bool = False  # its goodbye arrived: nothing more comes from it
    lost: str | None = None  # why it is unreachable, once it is
    last_sent: float = 0.0
    last_heard: float = 0.0

    @property
    def gone(self) -> bool:
        """Whether nothing more can come from it (it said goodbye, or it is lost)."""
        return self.heard_bye or self.lost is not None


class KeptValues:
    """The values a member keeps for the remote references other members (or itself) created on it.

    Keyed by ``(creator's rank, call id)``. A remote call is *creating* from the moment its request is
    accepted until its value is kept (or its handler fails); a release that arrives meanwhile (the creator
    dropped its reference at once) is remembered, and the value is then not kept. Values of a creator that
    is lost are dropped, and none of its values is kept afterwards. Thread-safe: one lock, and a condition
    that waiters of :meth:`wait_count` sleep on.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._values: dict[tuple[int, int], Any] = {}
        self._creating: set[tuple[int, int]] = set()
        self._released_early: set[tuple[int, int]] = set()
        self._lost: set[int] = set()

    def creating(self, key: tuple[int, int]) -> None:
        """Note that the remote call ``key`` runs (before its handler starts)."""
        with self._lock:
            self._creating.add(key)

    def abandon(self, key: tuple[int, int]) -> None:
        """The remote call ``key`` ends without a value (its handler failed, or it never ran)."""
        with self._lock:
            self._creating.discard(key)
            self._released_early.discard(key)

    def keep(self, key: tuple[int, int], value: Any) -> None:
        """Keep the value of remote call ``key``, unless it was released meanwhile or its creator is lost."""
        with self._lock:
            self._creating.discard(key)
            if key in self._released_early:
                self._released_early.discard(key)
            elif key[0] not in self._lost:
                self._values[key] = value
            self._changed.notify_all()

    def get(self, key: tuple[int, int], what: str) -> Any:
        """The value kept for ``key``.

        Raises:
            KeyError: If it is released or was never kept (``what`` names it in the message).
        """
        with self._lock:
            try:
                return self._values[key]
            except KeyError:
                raise KeyError(f"{what} is released or was never kept") from None

    def release(self, key: tuple[int, int]) -> None:
        """Drop the value kept for ``key`` (or, while it is being created, the value to come)."""
        with self._lock:
            if key in self._creating:
                self._released_early.add(key)
            self._values.pop(key, None)
            self._changed.notify_all()

    def forget(self, creator: int) -> None:
        """Drop every value kept for ``creator``, which is lost, and keep none of its values from now on."""
        with self._lock:
            self._lost.add(creator)
            for key in [k for k in self._values if k[0] == creator]:
                del self._values[key]
            self._changed.notify_all()

    def count(self, creator: int | None = None) -> int:
        """How many values are kept (for ``creator`` only, if given)."""
        with self._lock:
            return self._count_locked(creator)

    def wait_count(self, count: int, timeout: float, creator: int | None = None) -> bool:
        """Wait up to ``timeout`` seconds until :meth:`count` is ``count``; whether it is."""
        with self._lock:
            return self._changed.wait_for(lambda: self._count_locked(creator) == count, timeout)

    def _count_locked(self, creator: int | None) -> int:
        return sum(1 for key in self._values if creator is None or key[0] == creator)
