"""Who belongs to an elastic job and who is alive: registration, heartbeats and the liveness view.

Keys (under the job's prefix)::

    name/<name>      the token of the process holding the name (compare_set: one holder per name)
    reg/n            number of registrations (add)
    reg/<i>          the i-th registered name (join order)
    hb/<name>        heartbeat counter, incremented every ``period`` by the member's heartbeat thread
    left/<name>      set when a member leaves cleanly (it is then dead at once for everyone)

Liveness needs no synchronised clocks: each observer notes, on its own monotonic clock, when it last saw a
member's counter change, and treats a member whose counter has not changed for ``member_timeout`` seconds
as dead. A member first seen by an observer counts as alive for ``member_timeout`` from that moment, and so
does a member that enlists again (one that was left out of a quorum because it was silent, and is back). The
same thread that beats refreshes this view, so one thread per member does both.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Sequence

from pc_distributed._store import BoundedStore

__all__ = ["Membership"]

logger = logging.getLogger(__name__)


class Membership:
    """This member's registration and heartbeat, and its view of the others' liveness.

    Args:
        store: The heartbeat thread's own short-request client (job prefix).
        name: This member's name, unique in the job.
        period: Seconds between heartbeats.
        member_timeout: Seconds without a heartbeat after which a member counts as dead.
    """

    def __init__(self, store: BoundedStore, name: str, period: float, member_timeout: float) -> None:
        self._store = store
        self.name = name
        self._period = period
        self._timeout = member_timeout
        self._lock = threading.Lock()
        self._names: list[str] = []  # by registration order
        self._seen: dict[str, tuple[int, float]] = {}  # name -> (counter, monotonic time it last changed)
        self._left: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def claim(self) -> None:
        """Claim the name and send the first heartbeat.

        Raises:
            ValueError: If another process of the job holds the name.
        """
        token = uuid.uuid4().hex
        holder = self._store.compare_set(f"name/{self.name}", "", token).decode()
        if holder != token:
            raise ValueError(
                f"member name {self.name!r} is already used in this elastic job; every process (a restarted "
                "one too) needs a name of its own"
            )
        self._store.add(f"hb/{self.name}", 1)
        self.refresh()

    def enlist(self) -> None:
        """Add the name to the registry: from now on the others wait for this member at step boundaries.

        Called at the member's first step boundary, after its ready key is written, so that no member waits
        for one that is still setting up; and again by a member that was left out of a quorum (it was late,
        or silent: stopped, partitioned), so that the others count it alive again from that moment instead
        of waiting for their next read of its heartbeat.
        """
        index = self._store.add("reg/n", 1) - 1
        self._store.set(f"reg/{index}", self.name)
        self.refresh()

    def start(self) -> None:
        """Start the heartbeat thread (a daemon; :meth:`stop` ends it)."""
        self._thread = threading.Thread(
            target=self._run, name=f"pc-elastic-heartbeat: {self.name}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self._store.add(f"hb/{self.name}", 1)
                self.refresh()
            except (TimeoutError, ConnectionError, RuntimeError) as exc:
                # The training loop's own requests fail on the same store and raise there; keep the cause.
                self.error = exc
                logger.warning("elastic member %r: heartbeat failed: %r", self.name, exc)
                return

    def refresh_registry(self) -> None:
        """Read the names registered since the last read (one request when there are none)."""
        count = self._store.add("reg/n", 0)
        with self._lock:
            known = len(self._names)
        fresh = [self._store.get(f"reg/{i}").decode() for i in range(known, count)]
        with self._lock:
            if len(self._names) == known:  # another thread's refresh may have read them meanwhile
                self._names.extend(fresh)
                now = time.monotonic()
                for name in fresh:  # alive for member_timeout from (re-)enlisting, until its counter is read
                    self._seen[name] = (self._seen.get(name, (-1, now))[0], now)

    def refresh(self) -> None:
        """Read the registry and every member's heartbeat counter once; update the liveness view."""
        self.refresh_registry()
        now = time.monotonic()
        with self._lock:
            names = list(dict.fromkeys(self._names))
        counters = {}
        for name in names:
            if name in self._left or name == self.name:
                continue
            counters[name] = self._store.add(f"hb/{name}", 0)
            if self._store.check([f"left/{name}"]):
                with self._lock:
                    self._left.add(name)
        with self._lock:
            for name, counter in counters.items():
                last = self._seen.get(name)
                if last is None or last[0] != counter:
                    self._seen[name] = (counter, now)

    def alive(self, name: str) -> bool:
        """Whether ``name`` is a registered member that has not left and beat within ``member_timeout``."""
        if name == self.name:
            return True
        with self._lock:
            if name in self._left:
                return False
            last = self._seen.get(name)
        return last is not None and time.monotonic() - last[1] < self._timeout

    def until_expiry(self, names: Sequence[str]) -> float:
        """Seconds until the first of ``names`` that is alive now would count as dead if it beat no more.

        A wait for those members ends then at the latest, so that a member that died during the wait is
        seen dead one ``member_timeout`` after its last beat, not up to one wait later. ``inf`` if none of
        them is alive (or the only one is this member).
        """
        now = time.monotonic()
        with self._lock:
            last = [
                self._seen[n][1] for n in names if n != self.name and n not in self._left and n in self._seen
            ]
        ends = [t + self._timeout - now for t in last if t + self._timeout > now]
        return max(0.0, min(ends)) if ends else math.inf

    def registered(self) -> list[str]:
        """Every name registered so far, in join order."""
        with self._lock:
            return list(dict.fromkeys(self._names))  # a member that re-enlisted appears once

    def live(self) -> list[str]:
        """The registered members that are alive, in join order."""
        return [n for n in self.registered() if self.alive(n)]

    def dead(self) -> list[str]:
        """The registered members that are not alive (left, or silent past ``member_timeout``)."""
        return [n for n in self.registered() if not self.alive(n)]

    def leave(self, store: BoundedStore) -> None:
        """Stop beating and tell the others this member left (best effort: the store may be gone)."""
        self.stop()
        try:
            store.set(f"left/{self.name}", "1")
        except (TimeoutError, ConnectionError, RuntimeError) as exc:
            logger.debug("elastic member %r could not record its leave: %r", self.name, exc)

    def stop(self) -> None:
        """End the heartbeat thread (waits at most one store timeout for it)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(2 * self._period + 1.0)  # a thread stuck on a silent store is a daemon: left behind
