"""The gradient server's ledger: what became of every client push, per client and in total.

Each reducer process keeps its own book: a secondary counts what it accepted, refused and dropped; the primary
counts what it applied and dropped. Only the merged ledger of every reducer of one server balances::

    accepted == applied + dropped_stale + dropped_overflow + dropped_shutdown + dropped_error

once every reducer has stopped (secondaries first, then the primary). Pushes refused at once
(``refused_stale``) or recognised as a retry (``duplicates``) were never accepted a second time, and their
client learned it from ``push()``'s return value.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["GradLedger", "PushCounts"]

_DROPPED = ("dropped_stale", "dropped_overflow", "dropped_shutdown", "dropped_error")
_FIELDS = ("accepted", "duplicates", "refused_stale", "applied", *_DROPPED)


@dataclasses.dataclass
class PushCounts:
    """Counts of client pushes (of one client, or of all).

    Attributes:
        accepted: Pushes a secondary queued (``push()`` returned ``True``).
        duplicates: Retries of an already received ``(client, seq)``: answered as before, not queued again.
        refused_stale: Pushes refused at once as more than ``max_staleness`` behind (``push()`` returned
            ``False``); not accepted.
        applied: Accepted pushes contained in an optimizer step (each exactly once).
        dropped_stale: Accepted pushes dropped later because the model moved more than ``max_staleness`` on.
        dropped_overflow: Accepted pushes dropped from a full queue (``max_queue_size``).
        dropped_shutdown: Accepted pushes dropped because the primary had stopped before a secondary's final
            forward reached it (a warning is logged; stop the secondaries first to avoid it).
        dropped_error: Accepted pushes lost with a failed reducer thread (see ``watch()``).
    """

    accepted: int = 0
    duplicates: int = 0
    refused_stale: int = 0
    applied: int = 0
    dropped_stale: int = 0
    dropped_overflow: int = 0
    dropped_shutdown: int = 0
    dropped_error: int = 0

    @property
    def dropped(self) -> int:
        """Accepted pushes dropped for any reason."""
        return self.dropped_stale + self.dropped_overflow + self.dropped_shutdown + self.dropped_error

    @property
    def pending(self) -> int:
        """Accepted pushes neither applied nor dropped yet (0 in a balanced ledger)."""
        return self.accepted - self.applied - self.dropped

    def add(self, other: PushCounts) -> None:
        """Add ``other``'s counts to these.

        Args:
            other: The counts to add.
        """
        for name in _FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclasses.dataclass
class GradLedger:
    """A snapshot of the ledger: totals and per-client counts (clients keyed by their ``client_id``).

    A value: every ``ledger()`` call returns a new one that shares nothing with the server, so any thread may
    read it; :meth:`PushCounts.add` mutates its own object only.

    Attributes:
        total: The counts over all clients.
        clients: Per-client counts.
    """

    total: PushCounts = dataclasses.field(default_factory=PushCounts)
    clients: dict[str, PushCounts] = dataclasses.field(default_factory=dict)

    def balanced(self) -> bool:
        """Whether every accepted push was applied or dropped, in total and for each client."""
        return self.total.pending == 0 and all(c.pending == 0 for c in self.clients.values())

    @classmethod
    def merge(cls, ledgers: Iterable[GradLedger]) -> GradLedger:
        """Sum the ledgers of several reducer processes (of one server) into one.

        Args:
            ledgers: The reducers' ledgers.

        Returns:
            The merged ledger.
        """
        out = cls()
        for ledger in ledgers:
            out.total.add(ledger.total)
            for client, counts in ledger.clients.items():
                out.clients.setdefault(client, PushCounts()).add(counts)
        return out


class LedgerBook:
    """A reducer process's thread-safe ledger (internal; read it through ``snapshot()``).

    Attributes:
        lock: Re-entrant; the reducers' queues share it, so a push moves between a queue and a ledger entry
            in one step and a checkpoint taken under it sees each push exactly once (queued or booked).
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._ledger = GradLedger()

    def record(self, field: str, per_client: Mapping[str, int]) -> int:
        """Add ``per_client`` counts to ``field`` of each client and of the total; return their sum.

        Raises:
            ValueError: ``field`` is not a :class:`PushCounts` field.
        """
        if field not in _FIELDS:
            raise ValueError(f"unknown ledger field {field!r}; expected one of {_FIELDS}")
        added = 0
        with self.lock:
            for client, n in per_client.items():
                counts = self._ledger.clients.setdefault(client, PushCounts())
                setattr(counts, field, getattr(counts, field) + n)
                added += n
            setattr(self._ledger.total, field, getattr(self._ledger.total, field) + added)
        return added

    def snapshot(self) -> GradLedger:
        """A deep copy of the current ledger."""
        with self.lock:
            return GradLedger(
                dataclasses.replace(self._ledger.total),
                {c: dataclasses.replace(n) for c, n in self._ledger.clients.items()},
            )

    def state(self) -> dict[str, Any]:
        """The counts as plain dicts (for a checkpoint): ``{"total": {...}, "clients": {client: {...}}}``."""
        snap = self.snapshot()
        return {
            "total": dataclasses.asdict(snap.total),
            "clients": {c: dataclasses.asdict(n) for c, n in snap.clients.items()},
        }

    def load(self, state: object) -> None:
        """Replace the counts with :meth:`state`'s output.

        Raises:
            ValueError: A missing or unknown field, a negative or non-int count (named in the message), or a
                total that is not the sum of the clients' counts.
        """
        if not isinstance(state, Mapping) or not isinstance(state.get("clients"), Mapping):
            raise ValueError(f"ledger state must be {{'total': ..., 'clients': {{...}}}}, got {state!r}")
        total = _counts("ledger total", state.get("total"))
        clients = {str(c): _counts(f"ledger of client {c!r}", n) for c, n in state["clients"].items()}
        summed = PushCounts()
        for counts in clients.values():
            summed.add(counts)
        if summed != total:
            raise ValueError(f"ledger total {total} is not the sum of its clients' counts {summed}")
        with self.lock:
            self._ledger = GradLedger(total, clients)


def _counts(what: str, value: object) -> PushCounts:
    if not isinstance(value, Mapping) or set(value) != set(_FIELDS):
        raise ValueError(f"{what} must map exactly the fields {_FIELDS}, got {value!r}")
    for name in _FIELDS:
        n = value[name]
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{what}: {name} must be an int >= 0, got {n!r}")
    return PushCounts(**{name: int(value[name]) for name in _FIELDS})
