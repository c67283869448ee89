"""The directory of an RPC group: which member owns each paired value and registered service.

The directory lives in the World's store: ``rg/<group>/dir/<kind>/<repr(key)>`` holds the owner's name, set
with an atomic compare-and-set (the first writer wins). The value or service itself lives only in the owner's
locked local table (``_remote.GroupTables``). Callers cache ``key -> owner``, so a call on the hot path needs
no store request; an owner that lost the key answers "missing" and the caller looks up again.

No lock is held across a store request: a key whose claim or release is in flight is marked pending in the
tables, and an incoming call for that very key waits until it settled (``GroupTables.wait_settled``).
"""

from __future__ import annotations

import threading
from typing import Any

from pc_distributed._host import GroupHost
from pc_distributed._store import claim, lookup, release
from pc_distributed.rpc._remote import SERVICE, VALUE, GroupTables

__all__ = ["Directory"]


class Directory:
    """An RPC group's view of its directory: look-ups with a ``key -> owner`` cache, claims and releases.

    Args:
        host: The World holding the store.
        group_name: Name of the group.
    """

    def __init__(self, host: GroupHost, group_name: str) -> None:
        self._host = host
        self._group = group_name
        self._cache: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def key(self, kind: str, ktext: str) -> str:
        """The store key of ``(kind, ktext)``."""
        return f"rg/{self._group}/dir/{kind}/{ktext}"

    def owner(self, kind: str, ktext: str, refresh: bool) -> str | None:
        """The owner of ``(kind, ktext)``: from the cache unless ``refresh``, else from the store."""
        ck = (kind, ktext)
        if not refresh:
            with self._lock:
                cached = self._cache.get(ck)
            if cached is not None:
                return cached
        owner = lookup(self._host.store, self.key(kind, ktext))
        with self._lock:
            if owner is None:
                self._cache.pop(ck, None)
            else:
                self._cache[ck] = owner
        return owner

    def claim(self, tables: GroupTables, kind: str, ktext: str, obj: Any, taken: str) -> None:
        """Put ``obj`` in this process's ``tables`` and claim ``(kind, ktext)`` in the store; undo if taken.

        The table entry comes first, so the directory never names an owner that lacks the object. The table
        lock is not held across the store request (other threads' calls and registrations go on meanwhile);
        the key is marked pending instead, and a call for this very key waits until the claim settled.

        Raises:
            KeyError: ``taken``, if this process or another one holds the key.
        """
        me = self._host.name
        table: dict[str, Any] = tables.values if kind == VALUE else tables.services
        with tables.lock:
            if ktext in table or (kind, ktext) in tables.pending:
                raise KeyError(taken)
            table[ktext] = obj
            tables.pending.add((kind, ktext))
        won = False
        try:
            won = claim(self._host.store, self.key(kind, ktext), me) == me
        finally:
            with tables.lock:
                tables.pending.discard((kind, ktext))
                if not won:
                    del table[ktext]
                tables.settled.notify_all()
        if not won:
            raise KeyError(taken)
        with self._lock:
            self._cache[(kind, ktext)] = me

    def release(self, tables: GroupTables, kind: str, ktext: str, not_owner: str) -> None:
        """Remove this process's entry and its directory key (the table lock is not held across the store).

        Raises:
            KeyError: ``not_owner``, if this process does not hold the key.
        """
        me = self._host.name
        table: dict[str, Any] = tables.values if kind == VALUE else tables.services
        with tables.lock:
            if ktext not in table or (kind, ktext) in tables.pending:
                raise KeyError(not_owner)
            tables.pending.add((kind, ktext))
        released = False
        try:
            release(self._host.store, self.key(kind, ktext), me)
            released = True
        finally:
            with tables.lock:
                tables.pending.discard((kind, ktext))
                if released:
                    del table[ktext]
                tables.settled.notify_all()
        with self._lock:
            self._cache.pop((kind, ktext), None)

    def release_all(self, tables: GroupTables) -> None:
        """Remove every directory entry this process owns in ``tables`` (the tables are already dropped)."""
        with tables.lock:
            entries = [(VALUE, k) for k in tables.values] + [(SERVICE, k) for k in tables.services]
        for kind, ktext in entries:
            release(self._host.store, self.key(kind, ktext), self._host.name)
