"""What both reducer roles share: the queued push, the process's health, a queue-draining thread.

Each reducer role owns one :class:`~pc_server.grad._batch_queue.BatchQueue` and one thread running the
batch loop of :class:`ReducerRole` (the roles differ only in how they reduce and where they deliver). The
first failure of either role is kept in the process's :class:`ReducerHealth` (re-raised by ``watch()``),
closes both queues, and whatever the failed role held is booked as ``dropped_error`` in the ledger: nothing
is lost without a count.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any, Generic, NamedTuple, TypeVar

from pc_server._packing import Packed
from pc_server.errors import ReducerTraceback
from pc_server.grad._batch_queue import BatchQueue
from pc_server.grad._protocol import Forward
from pc_server.grad._reduce import Partial, drop_stale
from pc_server.grad.config import GradServerConfig
from pc_server.grad.ledger import LedgerBook

__all__ = [
    "Booking",
    "Queued",
    "ReducerHealth",
    "ReducerRole",
    "forward_clients",
    "per_client",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Queued(NamedTuple):
    """A client push waiting in a secondary's queue."""

    version: int
    grads: Packed
    enqueued: float
    client: str


Booking = tuple[str, dict[str, int]]
"""A ledger field and the pushes per client to add to it."""


def per_client(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    """Sum per-client counts."""
    total: Counter[str] = Counter()
    for c in counts:
        total.update(c)
    return dict(total)


def forward_clients(forward: Forward) -> dict[str, int]:
    """The pushes per client inside a bundle."""
    return per_client(clients for _sums, _n, clients in forward.partials.values())


class ReducerHealth:
    """The first failure among a process's reducer threads, and the condition the primary notifies on."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self._text = ""
        self._on_failure: list[Callable[[], None]] = []

    def on_failure(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` (e.g. closing a queue) when a reducer thread fails."""
        self._on_failure.append(callback)

    def fail(self, exc: BaseException, text: str) -> None:
        """Record ``exc`` (the first failure wins), wake waiters and run the failure callbacks."""
        with self.cond:
            if self.error is None:
                self.error, self._text = exc, text
            self.cond.notify_all()
        for callback in self._on_failure:
            callback()

    def raise_if_failed(self) -> None:
        """Re-raise the first failure with the thread's traceback as ``__cause__``."""
        err = self.error
        if err is not None:
            if err.__cause__ is None:
                err.__cause__ = ReducerTraceback(self._text)
            raise err


class ReducerRole(Generic[T]):
    """One reducer role: a batch queue drained by one thread, which this class runs.

    The loop takes a batch (held by the queue until released), reduces it into per-version groups
    (:meth:`_reduce`, outside any lock), then, under :meth:`_guard`, drops the groups more than
    ``max_staleness`` behind :meth:`_head` and hands the rest on (:meth:`_deliver`). The outcome is booked and
    the batch released under the ledger's lock in one step, so a checkpoint sees each push once.
    """

    role = "reducer"

    def __init__(
        self, config: GradServerConfig, ledger: LedgerBook, health: ReducerHealth, on_drop: Callable[[T], Any]
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.health = health
        self.queue: BatchQueue[T] = BatchQueue(
            config.max_queue_size,
            f"{config.server_name} {self.role} queue",
            on_drop=on_drop,
            lock=ledger.lock,
        )
        self._thread: threading.Thread | None = None
        self._restored: list[T] = []  # what the last restore_pending() queued
        health.on_failure(self.queue.close)

    # ------------------------------------------------------------------ what a role defines
    def _clients_of(self, item: T) -> dict[str, int]:
        """The client pushes inside one queued item."""
        raise NotImplementedError

    def _reduce(self, batch: list[T]) -> tuple[dict[int, Partial], dict[int, Counter[str]]]:
        """Sum a batch per model version; also return each version's pushes per client."""
        raise NotImplementedError

    def _head(self) -> int:
        """The newest model version known here (staleness is measured against it)."""
        raise NotImplementedError

    def _guard(self) -> AbstractContextManager[Any]:
        """Held while a batch is judged, delivered and booked (default: nothing)."""
        return contextlib.nullcontext()

    def _deliver(
        self, kept: dict[int, Partial], clients: dict[int, Counter[str]], batch: list[T]
    ) -> Booking | None:
        """Hand on the fresh groups of ``batch``; return what to book for them (``None``: nothing here)."""
        raise NotImplementedError

    def restore_pending(self, items: list[T]) -> None:
        """Queue a checkpoint's held items in place of what the previous restore queued (before start).

        Loading the same checkpoint twice therefore queues its items once; items that arrived otherwise stay.
        """
        with self.ledger.lock:
            self.queue.remove(self._restored)
            for item in items:
                self.queue.put(item)
            self._restored = list(items)

    # ------------------------------------------------------------------ the thread
    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run_guarded, name=f"pc-server {self.config.server_name} {self.role}", daemon=True
            )
            self._thread.start()

    def stop(self, timeout: float | None) -> None:
        """Close the queue and join the thread, which drains it first.

        Raises:
            TimeoutError: The thread did not finish within ``timeout``.
        """
        self.queue.close()
        if self._thread is None:  # never started: nothing will reduce what was queued; book it
            n = self.ledger.record("dropped_shutdown", per_client(map(self._clients_of, self.queue.drain())))
            if n:
                logger.warning(
                    "gradient server %r: the %s reducer on %r was never started; dropping %d queued pushes",
                    self.config.server_name,
                    self.role,
                    self.config.me,
                    n,
                )
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(
                f"gradient server {self.config.server_name!r}: the {self.role} reducer on {self.config.me!r} "
                f"did not stop within {timeout} s"
            )

    def _loop(self) -> None:
        cfg = self.config
        while True:
            batch = self.queue.get_batch(cfg.reduce_batch_size, cfg.flush_timeout)
            if batch is None:
                return
            groups, clients = self._reduce(batch)
            with self._guard():
                kept, _dropped = drop_stale(groups, self._head(), cfg.max_staleness)
                booking = self._deliver(kept, clients, batch) if kept else None
                with self.ledger.lock:
                    self.ledger.record(
                        "dropped_stale", per_client(clients[v] for v in groups if v not in kept)
                    )
                    if booking is not None:
                        self.ledger.record(*booking)
                    self.queue.release()

    def _run_guarded(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # reported through watch(): the first failure of this process
            self.health.fail(exc, traceback.format_exc())
            logger.error(
                "gradient server %r: reducer on %r failed: %r", self.config.server_name, self.config.me, exc
            )
            # account for what this thread held or would have reduced: nothing is lost silently
            with self.ledger.lock:
                self.ledger.record("dropped_error", per_client(map(self._clients_of, self.queue.drain())))
