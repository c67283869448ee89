"""What users of the store layer hold: the client of short requests and the waiter of blocking waits.

Both are protocols, so that the groups and the barrier depend on what they call, not on the World's concrete
:class:`~pc_distributed._store._bounded_store.BoundedStore` and
:class:`~pc_distributed._store._waits.WaitStores` (tests hand in torch stores directly).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Protocol

__all__ = ["StoreClient", "Waiter"]


class StoreClient(Protocol):
    """The short store requests the groups make (the World's bounded shared client)."""

    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, amount: int) -> int: ...
    def check(self, keys: Sequence[str]) -> bool: ...
    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...
    def delete_key(self, key: str) -> bool: ...
    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None: ...


class Waiter(Protocol):
    """Something that blocks until keys exist (``WaitStores``): raises the store's error on a timeout."""

    def wait(self, keys: Sequence[str], timeout: float) -> None: ...
