"""Blocking store waits on connections of their own, so that a waiting thread never stalls the others.

A torch ``TCPStore`` client runs one request at a time: a ``wait`` holds the client (and its socket) until the
keys appear or the timeout passes, and every other thread's ``get``/``set``/``compare_set`` on that client
queues behind it. A barrier or a group join waiting for a slow peer would therefore stall every directory
look-up, claim and ``stop`` of the whole process. :class:`WaitStores` hands each blocking wait a client of its
own from a small pool (opened on first use, kept for the next wait, closed with the World), so the World's
shared client only ever carries short requests.

Why a pool of dedicated connections rather than the alternatives (numbers in ``docs/distributed.md``):
waiting in bounded slices on the shared client still stalls other threads for up to about two slices (the
client's lock is not fair) and logs two warnings per expired slice; polling with ``check`` adds its period to
every wake-up and loads the server; an RPC-based barrier would need RPC threads and its own failure handling.
A dedicated connection costs about a millisecond to open once, and nothing per wait afterwards.

Stores other than ``TCPStore`` (``FileStore``) do not hold a lock across a wait, so waits use them directly.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from pc_distributed._bounded import WAIT_GRACE, call_bounded
from pc_distributed._store._torch_store import prefix_store, store_client

__all__ = ["StoreClosedError", "WaitStores"]


class StoreClosedError(RuntimeError):
    """A wait was started after the World's stores were closed (``World.stop``)."""


class WaitStores:
    """A pool of store clients for blocking waits, each a view with the World's key prefix.

    Args:
        raw: The World's raw store (a ``TCPStore`` gets dedicated clients; other stores are used directly).
        prefix: The key prefix of the World's store view.
        timeout: Seconds of the clients' connect and request timeout.
    """

    def __init__(self, raw: Any, prefix: str, timeout: float) -> None:
        self._raw = raw
        self._prefix = prefix
        self._timeout = timeout
        self._free: list[Any] = []
        self._lock = threading.Lock()
        self._closed = False
        self._shared = prefix_store(prefix, raw)

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        """Block until every key (relative to the prefix) exists, on a client no other thread uses.

        Raises:
            StoreClosedError: If :meth:`close` was called.
            RuntimeError: The store's error (``DistStoreError`` is one) when ``timeout`` passes or the
                connection fails; callers turn it into a ``TimeoutError`` naming what was missing.
            TimeoutError: If the server did not even answer within ``timeout`` plus ``WAIT_GRACE``.
        """
        client = self._borrow()
        if client is None:
            self._shared.wait(list(keys), timedelta(seconds=timeout))
            return
        # After its timeout torch's client asks the server to cancel the wait and blocks for the answer with
        # no deadline: against a silent server (frozen, partitioned away) the wait itself must be bounded.
        call_bounded(
            lambda: client.wait(list(keys), timedelta(seconds=timeout)),
            timeout + WAIT_GRACE,
            f"store wait for {list(keys)[:3]}",
        )
        # Only a client whose wait completed goes back: after a timeout or a connection error the server may
        # still hold the cancelled wait, so that connection is dropped (closed when collected).
        self._give_back(client)

    def idle_clients(self) -> int:
        """Number of pooled clients not in use (for tests and diagnostics)."""
        with self._lock:
            return len(self._free)

    def close(self) -> None:
        """Drop the pooled clients; clients still in a wait are dropped when it ends (idempotent)."""
        with self._lock:
            self._closed = True
            self._free.clear()

    def _borrow(self) -> Any | None:
        with self._lock:
            if self._closed:
                raise StoreClosedError("the World's store has been closed (World.stop)")
            if self._free:
                return self._free.pop()
        client = store_client(self._raw, self._timeout)
        return None if client is None else prefix_store(self._prefix, client)

    def _give_back(self, client: Any) -> None:
        with self._lock:
            if not self._closed:
                self._free.append(client)
