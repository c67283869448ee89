"""A bounded batching queue for the reducer threads: wake on a full batch, a due deadline, or close.

One ``threading.Condition`` guards the items, so a ``put`` between the consumer's check and its wait cannot be
lost (an ``Event.set(); clear()`` pulse could), and the consumer sleeps exactly until the oldest item is
due instead of polling every 0.1 s. A batch handed to the consumer stays *held* by the queue until the
consumer calls :meth:`BatchQueue.release`, so a checkpoint (:meth:`BatchQueue.pending`) sees every item the
reducer has not finished with, and a failed reducer's :meth:`BatchQueue.drain` returns them too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from pc_server.errors import ReducerStoppedError

__all__ = ["BatchQueue"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Idle waits re-check their predicate this often; wake-ups come from notify(), this only bounds each wait.
_IDLE_WAIT_S = 5.0


class BatchQueue(Generic[T]):
    """A FIFO of items with ages, handed out in batches.

    Args:
        max_size: Beyond this many items the oldest are dropped (counted in :attr:`dropped`, warned once).
        name: For log messages.
        on_drop: Called with each item dropped on overflow (under the queue's lock: keep it short).
        lock: The lock of the queue's condition (default: a new one); the gradient server shares its ledger's
            lock so that an item moves between queue and ledger in one step.
    """

    def __init__(
        self,
        max_size: int,
        name: str = "queue",
        on_drop: Callable[[T], object] | None = None,
        lock: threading.RLock | None = None,
    ) -> None:
        self._items: deque[tuple[float, T]] = deque()
        self._held: list[T] = []  # the batch the consumer took and has not released
        self._cond = threading.Condition(lock)
        self._max_size = max_size
        self._name = name
        self._closed = False
        self._warned = False
        self._on_drop = on_drop
        self.dropped = 0

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def put(self, item: T, age: float = 0.0) -> bool:
        """Append ``item``; ``age`` seconds are counted as already waited (for forwarded, older work).

        Args:
            item: The item.
            age: How long the item (or its oldest part) has already waited elsewhere.

        Returns:
            ``True`` if the oldest item had to be dropped to make room.

        Raises:
            ReducerStoppedError: The queue is closed.
        """
        with self._cond:
            if self._closed:
                raise ReducerStoppedError(f"{self._name} is closed (its reducer stopped or failed)")
            self._items.append((time.monotonic() - max(0.0, age), item))
            overflow = len(self._items) > self._max_size
            if overflow:
                _ts, lost = self._items.popleft()
                self.dropped += 1
                if self._on_drop is not None:
                    self._on_drop(lost)
                if not self._warned:
                    self._warned = True
                    logger.warning(
                        "%s overflowed max_queue_size=%d: dropping the oldest items (counted in stats)",
                        self._name,
                        self._max_size,
                    )
            self._cond.notify_all()
            return overflow

    def close(self) -> None:
        """Refuse further puts and wake the consumer, which then drains what is left."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def get_batch(self, batch_size: int, flush_timeout: float | None) -> list[T] | None:
        """Block until a batch is due and return it (oldest first).

        A batch is due when ``batch_size`` items wait, when the oldest has waited ``flush_timeout`` seconds
        (then up to ``batch_size`` items are returned), or when the queue is closed (then the rest drains in
        batches).

        Args:
            batch_size: Items per full batch.
            flush_timeout: Seconds after which a partial batch is flushed; ``None`` never flushes.

        Returns:
            The batch, or ``None`` once the queue is closed and empty. The batch is held (in :meth:`pending`)
            until :meth:`release`.
        """
        with self._cond:
            while True:
                n = len(self._items)
                if n >= batch_size or (self._closed and n):
                    return self._take(batch_size)
                if self._closed:
                    return None
                wait_s = _IDLE_WAIT_S
                if n and flush_timeout is not None:
                    oldest = min(ts for ts, _ in self._items)
                    due_in = oldest + flush_timeout - time.monotonic()
                    if due_in <= 0:
                        return self._take(batch_size)
                    wait_s = min(wait_s, due_in)
                self._cond.wait(wait_s)

    def release(self) -> None:
        """The consumer is done with the batch :meth:`get_batch` returned (it was booked elsewhere)."""
        with self._cond:
            self._held = []

    def pending(self) -> list[T]:
        """The held batch and the waiting items, oldest first (a copy; for a checkpoint)."""
        with self._cond:
            return [*self._held, *(item for _ts, item in self._items)]

    def remove(self, items: list[T]) -> None:
        """Remove these very items (compared by identity) from the waiting ones, wherever they are."""
        ids = {id(item) for item in items}
        with self._cond:
            self._items = deque((ts, item) for ts, item in self._items if id(item) not in ids)

    def drain(self) -> list[T]:
        """Remove and return the held batch and every waiting item (oldest first), e.g. after a failure."""
        with self._cond:
            items = [*self._held, *(item for _ts, item in self._items)]
            self._held = []
            self._items.clear()
            return items

    def _take(self, batch_size: int) -> list[T]:
        count = min(batch_size, len(self._items))
        self._held = [self._items.popleft()[1] for _ in range(count)]
        return list(self._held)
