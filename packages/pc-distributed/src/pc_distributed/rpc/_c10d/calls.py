"""The calls in flight of a c10d transport: each call until its reply, and their deadlines in order.

A :class:`PendingCall` is completed once, by whoever removes it from the :class:`PendingCalls` table (its
reply, its deadline, its peer's loss, shutdown).
"""

from __future__ import annotations

import heapq
import threading
from concurrent.futures import Future as _Future
from dataclasses import dataclass, field
from typing import Any

from pc_distributed.rpc._c10d.codec import Encoded
from pc_distributed.rpc._c10d.frames import Incoming, Posted

__all__ = ["PendingCall", "PendingCalls"]


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
