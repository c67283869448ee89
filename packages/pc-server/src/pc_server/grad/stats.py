"""The gradient server's per-process counters (a snapshot): the ledger's totals plus the reducers' own."""

from __future__ import annotations

import dataclasses

from pc_server.grad.ledger import PushCounts

__all__ = ["GradServerStats"]


@dataclasses.dataclass
class GradServerStats:
    """Counters of one reducer process (a snapshot; see :meth:`PushPullGradServerImpl.stats`).

    The push counts are this process's ledger totals (:attr:`pushes`); the per-client account of every push is
    :meth:`PushPullGradServerImpl.ledger`. The other attributes are the reducers' own.

    Attributes:
        pushes: This process's ledger totals (a secondary books accepted, refused and dropped pushes; the
            primary applied and dropped ones).
        forwarded: Partial-sum bundles sent to the primary (secondary).
        steps: Optimizer steps taken (primary).
        version: The managed model's version (primary; else the newest version this secondary has heard of).
    """

    pushes: PushCounts = dataclasses.field(default_factory=PushCounts)
    forwarded: int = 0
    steps: int = 0
    version: int = 0

    @property
    def received(self) -> int:
        """Client pushes accepted (queued) here (as a secondary): ``pushes.accepted``."""
        return self.pushes.accepted

    @property
    def duplicates(self) -> int:
        """Client pushes recognised as a retry of a received ``(client, seq)``: ``pushes.duplicates``."""
        return self.pushes.duplicates

    @property
    def dropped_stale(self) -> int:
        """Pushes refused at once or dropped later as more than ``max_staleness`` behind."""
        return self.pushes.refused_stale + self.pushes.dropped_stale

    @property
    def dropped_overflow(self) -> int:
        """Pushes dropped because a queue exceeded ``max_queue_size``: ``pushes.dropped_overflow``."""
        return self.pushes.dropped_overflow

    @property
    def applied(self) -> int:
        """Client pushes contained in this process's optimizer steps (primary): ``pushes.applied``."""
        return self.pushes.applied
