"""A peer's send lane: the thread that waits, in order, for the sends posted to that peer.

A posted send must be waited for (a dropped ``Work`` is a send never made), yet the thread that posts a frame
must not wait for a slow or stalled peer. Keep-alives, releases, goodbyes and the sends of calls that end
without a reply are therefore handed to the peer's :class:`Lane`, which waits for each in turn.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from pc_distributed.rpc._c10d.codec import Encoded
from pc_distributed.rpc._c10d.frames import Posted
from pc_distributed.rpc._c10d.workers import STOP

__all__ = ["Lane"]


class Lane:
    """One daemon thread that waits for the sends handed to it, in order, until its last one or :meth:`stop`.

    Each wait is bounded by the link's timeout (gloo's); a send that fails calls ``on_failure`` with why, and
    ends the lane.

    Args:
        name: The thread's name.
        on_failure: Called (on the lane's thread) with why a send failed: the peer is lost.
    """

    def __init__(self, name: str, on_failure: Callable[[str], None]) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._on_failure = on_failure
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread (sends handed over before it starts are waited for once it runs)."""
        self.thread.start()

    def wait_for(self, posted: Posted, message: Encoded | None, last: bool = False) -> None:
        """Wait for ``posted`` on the lane, keeping ``message`` (which its sends read) alive until it is done.

        ``last``: it is the peer's last frame (our goodbye), after which the lane ends.
        """
        self._queue.put((posted, message, last))

    def stop(self) -> None:
        """End the lane once the sends handed over before this are waited for."""
        self._queue.put(STOP)

    def _run(self) -> None:
        while True:
            item = self._queue.get()  # woken by a posted frame or by the sentinel of shutdown / loss
            if item is STOP:
                return
            posted, _message, last = item  # _message: read by the sends until they are done
            try:
                posted.wait()
            except RuntimeError as exc:
                self._on_failure(f"a send to it failed ({exc})")
                return
            del posted, _message, item
            if last:
                return
