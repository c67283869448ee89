"""The gradient server's per-process counters (a snapshot type)."""

from __future__ import annotations

import dataclasses

__all__ = ["GradServerStats"]


@dataclasses.dataclass
class GradServerStats:
    """Counters of one reducer process (a snapshot; see :meth:`PushPullGradServerImpl.stats`).

    The per-client account of every push is :meth:`PushPullGradServerImpl.ledger`.

    Attributes:
        received: Client pushes accepted (queued) here (as a secondary).
        duplicates: Client pushes recognised as a retry of a received ``(client, seq)``.
        dropped_stale: Pushes refused or dropped because their version was more than ``max_staleness`` behind.
        dropped_overflow: Queue items (a push, or a forwarded bundle) dropped because a queue exceeded
            ``max_queue_size``.
        forwarded: Partial-sum bundles sent to the primary.
        steps: Optimizer steps taken (primary).
        applied: Client pushes contained in those steps (primary).
        version: The managed model's version (primary; else the newest version this secondary has heard of).
    """

    received: int = 0
    duplicates: int = 0
    dropped_stale: int = 0
    dropped_overflow: int = 0
    forwarded: int = 0
    steps: int = 0
    applied: int = 0
    version: int = 0
