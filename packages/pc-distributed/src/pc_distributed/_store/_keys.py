"""Atomic claims and look-ups of keys in a store: first writer wins, each in one round trip.

An :class:`~pc_distributed.RpcGroup`'s directory (who owns a value or a service) is kept with these: only the
store is used (no RPC threads), so nothing ever nests an RPC inside an RPC handler.
"""

from __future__ import annotations

from pc_distributed._store._torch_store import Store

__all__ = ["claim", "lookup", "release"]


# compare_set on a missing key with a non-empty expected value returns that value unchanged and sets nothing,
# so comparing against a value no owner can have is an atomic one-round-trip look-up. Only for keys nobody
# waits on: torch's libuv TCPStore server wakes the waiters of the missing key as if it had been set.
_ABSENT = "\x00absent"


def claim(store: Store, key: str, owner: str) -> str:
    """Set ``key`` to ``owner`` if it is unset (atomically); return the recorded owner (first writer wins)."""
    return _text(store.compare_set(key, "", owner))


def lookup(store: Store, key: str) -> str | None:
    """Return the value recorded under ``key``, or None (one atomic round trip; a key nobody waits on)."""
    value = _text(store.compare_set(key, _ABSENT, _ABSENT))
    return None if value == _ABSENT else value


def release(store: Store, key: str, owner: str) -> bool:
    """Delete ``key`` if ``owner`` holds it; return whether it did."""
    if lookup(store, key) != owner:
        return False
    return bool(store.delete_key(key))


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value
