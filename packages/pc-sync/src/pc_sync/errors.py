"""Errors raised by pc-sync, and the default timeout of every synchronisation wait.

Each error subclasses the closest standard exception, so existing ``except`` clauses keep working:
:class:`SyncError` is a :class:`RuntimeError`, :class:`SyncTimeoutError` is also a :class:`TimeoutError`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

__all__ = ["DEFAULT_SYNC_TIMEOUT", "SyncAbortedError", "SyncError", "SyncTimeoutError"]

DEFAULT_SYNC_TIMEOUT: float = 300.0
"""Seconds a master or a slave waits for its peers before raising :class:`SyncTimeoutError`."""


class SyncError(RuntimeError):
    """A master/slave exchange broke its protocol (unknown or repeated id, malformed reply, full slot)."""


class SyncTimeoutError(SyncError, TimeoutError):
    """A participant did not answer in time.

    Attributes:
        missing: The identifiers that were not heard from (``(0,)`` when a slave waited for the master).
    """

    def __init__(self, message: str, missing: Iterable[Hashable] = ()) -> None:
        super().__init__(message)
        self.missing: tuple[Hashable, ...] = tuple(missing)

    def __reduce__(self) -> tuple[type[SyncTimeoutError], tuple[str, tuple[Hashable, ...]]]:
        return (type(self), (str(self), self.missing))


class SyncAbortedError(SyncError):
    """The exchange was aborted (a peer failed or timed out); ``__cause__`` holds the original error."""
