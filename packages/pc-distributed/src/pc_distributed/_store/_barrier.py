"""Timed waits for keys and a repeatable barrier, both on a store.

Every blocking wait goes through a :class:`~pc_distributed._store._client.Waiter` (the World's
:class:`~pc_distributed._store._waits.WaitStores`, a connection of its own), so that a thread waiting here
never stalls another thread's short requests on the shared client; a timeout becomes a ``TimeoutError`` naming
what was missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from pc_distributed._store._client import Waiter
from pc_distributed._store._torch_store import Store
from pc_distributed._store._waits import StoreClosedError

__all__ = ["StoreBarrier", "arrival_key", "wait_keys"]


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
