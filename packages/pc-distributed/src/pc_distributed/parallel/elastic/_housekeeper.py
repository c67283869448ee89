"""What a committed step leaves to tidy in the store, sent on a thread of its own.

After a commit, the step's housekeeper (its quorum's last member by name) records the job's committed steps
(``committed``: how new members tell a job whose state they must receive from one they may start) and
deletes the keys of the attempts :data:`~pc_distributed.parallel.elastic._quorum.RETAIN` before it (about
two keys per member and attempt). None of it is needed by the next step, and when the next quorum is decided
with the commit (:func:`~pc_distributed.parallel.elastic._quorum.propose_next`) a step boundary waits for
nobody, so a request on a member's path between two steps delays every member's next all-reduce. The
:class:`Housekeeper` sends them on a client of its own while its member trains.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

import pc_distributed.parallel.elastic._quorum as _quorum
from pc_distributed._store import BoundedStore

__all__ = ["Housekeeper"]

logger = logging.getLogger(__name__)


class Housekeeper:
    """One member's housekeeping thread (a daemon, started here; :meth:`close` ends it).

    Args:
        store: A short-request client of the job's keys that no other thread uses.
        registered: Every name registered so far (whose ready keys an attempt may hold).
        name: The member's name (names the thread and the log lines).

    Attributes:
        error: The store error that stopped the thread, or None. The member's own requests fail on the same
            store and raise there; this is for diagnostics.
    """

    def __init__(self, store: BoundedStore, registered: Callable[[], Sequence[str]], name: str) -> None:
        self._store = store
        self._registered = registered
        self._name = name
        self._queue: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._forgotten: int | None = None  # the last attempt whose keys this member deleted
        self._closing = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"pc-elastic-housekeeper: {name}", daemon=True)
        self._thread.start()

    def record(self, committed: int, forget_up_to: int) -> None:
        """For a commit this member housekeeps: record ``committed``, forget attempts to ``forget_up_to``."""
        self._queue.put((committed, forget_up_to))

    def close(self, timeout: float) -> None:
        """End the thread after the request it is in, if any; wait ``timeout`` seconds at most (idempotent).

        Attempts it had not forgotten yet are left (the next housekeeper forgets from its own commit on).
        """
        self._closing.set()
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)  # one stuck on a silent store is a daemon, bounded by its client

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            committed, attempt = item
            if self._forgotten is None:  # the first commit this member housekeeps: start at its attempt
                self._forgotten = attempt - 1
            try:
                while True:  # only the newest record matters: catch up with it at once
                    newer = self._queue.get_nowait()
                    if newer is None:
                        self._queue.put(None)
                        break
                    committed, attempt = newer
            except queue.Empty:
                pass
            try:
                self._store.set("committed", str(committed))
                self._forget_up_to(attempt)
            except (TimeoutError, ConnectionError, RuntimeError) as exc:
                self.error = exc
                logger.warning("elastic member %r: housekeeping failed: %r", self._name, exc)
                return

    def _forget_up_to(self, attempt: int) -> None:
        """Delete the keys of the attempts up to ``attempt`` not yet deleted by this member.

        Every attempt up to a housekeeper's commit, aborted ones between included, is forgotten once; when
        the housekeeper changes, the new one starts at ``attempt``, leaving the keys of the few attempts
        aborted during the change (bounded by the job's membership changes, not by its steps).
        """
        assert self._forgotten is not None  # set by _run at the first record
        names = list(self._registered())
        for old in range(max(self._forgotten + 1, 0), attempt + 1):  # empty if forgotten already
            if self._closing.is_set():
                return
            _quorum.forget(self._store, old, names)
            self._forgotten = old
