"""The owner's side of remote values: the values a member keeps for the remote references made on it.

The transport keeps a value when a remote call's handler returns, drops it on the creator's release frame or
when the creator is lost, and serves fetches from it (:class:`KeptValues`).
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["KeptValues"]


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
