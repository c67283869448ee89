"""Small operations on a torch.distributed ``Store``: atomic claims, look-ups, timed waits and a barrier.

The directory of an :class:`~pc_distributed.RpcGroup` and all barriers live here. Only the store is used (no
RPC threads), so nothing ever nests an RPC inside an RPC handler. Short requests go through the World's shared
client; every blocking wait goes through :class:`~pc_distributed._store_waits.WaitStores` (a connection of
its own), so that a thread waiting here never stalls another thread's requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist

from pc_distributed._store_waits import StoreClosedError
from pc_distributed._torch_dist import Store

__all__ = ["StoreBarrier", "Waiter", "arrival_key", "claim", "lookup", "release", "wait_keys"]


class Waiter(Protocol):
    """Something that blocks until keys exist (``WaitStores``): raises the store's error on a timeout."""

    def wait(self, keys: Sequence[str], timeout: float) -> None: ...


# compare_set on a missing key with a non-empty expected value returns that value unchanged and sets nothing,
# so comparing against a value no owner can have is an atomic one-round-trip look-up.
_ABSENT = "\x00absent"


def claim(store: Store, key: str, owner: str) -> str:
    """Set ``key`` to ``owner`` if it is unset (atomically); return the recorded owner (first writer wins)."""
    return _text(store.compare_set(key, "", owner))


def lookup(store: Store, key: str) -> str | None:
    """Return the owner recorded under ``key``, or None (one atomic round trip)."""
    value = _text(store.compare_set(key, _ABSENT, _ABSENT))
    return None if value == _ABSENT else value


def release(store: Store, key: str, owner: str) -> bool:
    """Delete ``key`` if ``owner`` holds it; return whether it did."""
    if lookup(store, key) != owner:
        return False
    return bool(store.delete_key(key))


def wait_keys(store: Store, waiter: Waiter, keys: Sequence[str], timeout: float, what: str) -> None:
    """Wait until every key exists.

    Args:
        store: The store (short requests: the diagnosis after a timeout).
        waiter: Does the blocking wait on a connection of its own.
        keys: Keys to wait for.
        timeout: Seconds.
        what: Describes the wait for the error message.

    Raises:
        TimeoutError: Naming the keys still missing.
    """
    try:
        waiter.wait(keys, timeout)
    except StoreClosedError:
        raise
    except (RuntimeError, dist.DistStoreError) as exc:
        missing = [k for k in keys if not store.check([k])]
        if not missing:  # pragma: no cover - arrived right at the deadline
            return
        raise TimeoutError(f"{what}: timed out after {timeout:g} s waiting for {missing}") from exc


def arrival_key(prefix: str, generation: int, member: str) -> str:
    """The key a member sets when it enters generation ``generation`` of the barrier under ``prefix``."""
    return f"{prefix}/{generation}/arrived/{member}"


@dataclass(frozen=True)
class StoreBarrier:
    """A repeatable barrier of ``members`` under ``prefix`` in a store, as seen by member ``me``.

    Each generation is one barrier: every member marks itself arrived and increments a counter; the one
    reaching the group size sets a persistent ``done`` key (no pulse that a late waiter could miss) and
    deletes the keys of the previous generation, which every member has left by then. The wait runs on
    ``waiter`` (a connection of its own), so other threads' requests on ``store`` go on meanwhile.

    Args:
        store: The store (short requests).
        waiter: Does the blocking wait on a connection of its own.
        prefix: The barrier's keys live under it.
        me: This member's name.
        members: Every member's name.
    """

    store: Store
    waiter: Waiter
    prefix: str
    me: str
    members: Sequence[str]

    def enter(self, generation: int, timeout: float, wait: bool = True) -> None:
        """Enter generation ``generation`` and block until every member entered it.

        Args:
            generation: The barrier's number, the same on every member (0, 1, ... in order).
            timeout: Seconds to wait for the others.
            wait: False to arrive without waiting (a member that leaves must not hold the others up).

        Raises:
            TimeoutError: Naming the members that did not arrive.
        """
        store, prefix, members = self.store, self.prefix, self.members
        base = f"{prefix}/{generation}"
        store.set(arrival_key(prefix, generation, self.me), "1")
        if store.add(f"{base}/n", 1) == len(members):
            store.set(f"{base}/done", "1")
            if generation > 0:
                old = f"{prefix}/{generation - 1}"
                for key in (f"{old}/n", f"{old}/done", *(f"{old}/arrived/{m}" for m in members)):
                    store.delete_key(key)
        if not wait:
            return
        try:
            self.waiter.wait([f"{base}/done"], timeout)
        except StoreClosedError:
            raise
        except (RuntimeError, dist.DistStoreError) as exc:
            if store.check([f"{base}/done"]):  # pragma: no cover - completed right at the deadline
                return
            missing = [m for m in members if not store.check([arrival_key(prefix, generation, m)])]
            raise TimeoutError(
                f"barrier {prefix!r} timed out after {timeout:g} s; members that did not arrive: {missing}"
            ) from exc


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value
