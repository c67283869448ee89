"""The secondary reducer: accepts client pushes, reduces batches into per-version partial sums, forwards them.

It owns its queue, its thread, its ``(client, seq)`` table and the gradient schema. Forwards go through the
``forward`` callable it is given: a direct call into the primary when both share a process, else one RPC
addressed by the primary's member name to its forward service (``RpcGroup.registered_sync(..., owner=)``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from pc_server._checkpoint import check_int
from pc_server._packing import Packed, pack, unpack
from pc_server.errors import ReducerStoppedError
from pc_server.grad._protocol import Done, Forward, GradMessage
from pc_server.grad._reduce import Partial, reduce_pushes
from pc_server.grad._reducer_base import (
    Booking,
    Queued,
    ReducerHealth,
    ReducerRole,
    forward_clients,
)
from pc_server.grad.config import GradServerConfig
from pc_server.grad.ledger import LedgerBook

__all__ = ["SecondaryReducer"]

logger = logging.getLogger(__name__)

ForwardFn = Callable[[Forward | Done, float], int]


class SecondaryReducer(ReducerRole[Queued]):
    """A secondary reducer of one process.

    Args:
        config: The server's settings.
        ledger: The process's ledger.
        health: The process's failure record.
        forward: Sends a bundle (or the final :class:`Done`) to the primary; returns its model version.
        local_head: The primary's version when it lives in this process (else the head is learned from
            clients and from the primary's replies).
    """

    role = "secondary"

    def __init__(
        self,
        config: GradServerConfig,
        ledger: LedgerBook,
        health: ReducerHealth,
        forward: ForwardFn,
        local_head: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(
            config, ledger, health, lambda item: ledger.record("dropped_overflow", {item.client: 1})
        )
        self._forward = forward
        self._local_head = local_head
        self._lock = threading.Lock()  # guards the dedup table, the schema, the head and the counter
        self._last_seq: dict[str, tuple[int, bool]] = {}  # client -> (last seq, whether it was accepted)
        self._schema: tuple[tuple[str, ...], tuple[tuple[int, ...], ...]] | None = None
        self._known_head = 0
        self.forwarded = 0
        self._packed: dict[int, Packed] = {}  # the batch's groups, packed (reducer thread)

    def _clients_of(self, item: Queued) -> dict[str, int]:
        return {item.client: 1}

    @property
    def head(self) -> int:
        """The newest model version this secondary knows of."""
        return self._local_head() if self._local_head is not None else self._known_head

    def accept(self, message: GradMessage) -> tuple[bool, int]:
        """Book and queue one client push; return ``(accepted, head)``.

        A retry of the last ``(client, seq)`` is answered as the first time and not queued again; an older
        seq, a push more than ``max_staleness`` behind and one computed on a version ahead of the head are
        refused.

        Raises:
            ReducerStoppedError: The reducer stopped or failed.
            ValueError: The gradients' names or shapes differ from the first push's.
        """
        if self.health.error is not None or self.queue.closed:
            raise ReducerStoppedError(
                f"gradient server {self.config.server_name!r}: the reducer on {self.config.me!r} "
                f"{'failed' if self.health.error is not None else 'was stopped'}; no pushes accepted"
            )
        schema = (message.grads.names, message.grads.shapes)
        # under the ledger's lock: queueing, the dedup entry and the booking are one step for a checkpoint
        with self.ledger.lock, self._lock:
            if self._schema is None:
                self._schema = schema
            elif schema != self._schema:
                raise ValueError(
                    f"gradient names/shapes {list(zip(*schema, strict=True))} differ from the first "
                    f"push's {list(zip(*self._schema, strict=True))}"
                )
            # A client that computed on version v proves the head is >= v; a co-located primary knows it.
            self._known_head = max(self._known_head, message.version)
            head = self.head
            last_seq, last_accepted = self._last_seq.get(message.client, (0, False))
            if message.seq <= last_seq:
                # a retry (the reply was lost): answer as the first time, never queue it twice
                self.ledger.record("duplicates", {message.client: 1})
                return (last_accepted if message.seq == last_seq else False), head
            stale = self.config.max_staleness
            # ahead of the head: a version this server never published (only a co-located primary tells)
            if message.version > head or (stale is not None and head - message.version > stale):
                self._last_seq[message.client] = (message.seq, False)
                self.ledger.record("refused_stale", {message.client: 1})
                return False, head
            self.queue.put(Queued(message.version, message.grads, time.monotonic(), message.client))
            self._last_seq[message.client] = (message.seq, True)
            self.ledger.record("accepted", {message.client: 1})
            return True, head

    def state(self) -> dict[str, Any]:
        """The ``(client, seq)`` table, the known head and the pushes not forwarded yet, for a checkpoint.

        Call it under the ledger's lock (as the checkpoint does) so that ``pending`` and the ledger agree.
        """
        with self.ledger.lock, self._lock:
            return {
                "dedup": {c: [seq, ok] for c, (seq, ok) in self._last_seq.items()},
                "head": self._known_head,
                "pending": [[it.version, it.grads, it.client] for it in self.queue.pending()],
            }

    def check_load(self, state: object) -> tuple[Callable[[], None], list[Queued]]:
        """Validate :meth:`state`'s output; change nothing yet (the caller validates every role first).

        Returns:
            The step that restores the dedup table and the known head, and the held pushes to queue again
            (:meth:`restore_pending`).

        Raises:
            ValueError: A malformed entry, named in the message.
        """
        if not isinstance(state, dict) or not isinstance(state.get("dedup"), dict):
            raise ValueError(f"secondary state must be {{'dedup': {{...}}, 'head': int}}, got {state!r}")
        table: dict[str, tuple[int, bool]] = {}
        for client, entry in state["dedup"].items():
            if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[1], bool)):
                raise ValueError(f"dedup entry of client {client!r} must be [seq, accepted], got {entry!r}")
            table[str(client)] = (check_int(f"dedup[{client!r}] seq", entry[0]), entry[1])
        head = check_int("secondary head", state.get("head"))
        pending = [_push(i, entry) for i, entry in enumerate(state.get("pending", []))]

        def restore() -> None:
            with self.ledger.lock, self._lock:
                self._last_seq = dict(table)
                self._known_head = head

        return restore, pending

    def say_done(self) -> None:
        """Tell the primary this secondary forwarded everything (after :meth:`stop`)."""
        try:
            self._forward(Done(self.config.me), 0.0)
        except (ReducerStoppedError, ConnectionError, TimeoutError, KeyError) as exc:
            logger.debug(
                "gradient server %r: primary not told %r is done: %r",
                self.config.server_name,
                self.config.me,
                exc,
            )

    def _reduce(self, batch: list[Queued]) -> tuple[dict[int, Partial], dict[int, Counter[str]]]:
        clients: dict[int, Counter[str]] = {}
        for item in batch:
            clients.setdefault(item.version, Counter())[item.client] += 1
        device = self.config.reduce_device
        groups = reduce_pushes(((it.version, unpack(it.grads, device)) for it in batch), None)
        self._packed = {v: pack(p.sums) for v, p in groups.items()}  # outside any lock (a copy)
        return groups, clients

    def _head(self) -> int:
        return self.head

    def _guard(self) -> AbstractContextManager[Any]:
        # co-located: the primary's queueing and this batch's release are one step for a checkpoint; a remote
        # forward is not held under a lock (until it returns, both processes' checkpoints hold the bundle)
        return self.ledger.lock if self._local_head is not None else contextlib.nullcontext()

    def _deliver(
        self, kept: dict[int, Partial], clients: dict[int, Counter[str]], batch: list[Queued]
    ) -> Booking | None:
        forward = Forward({v: (self._packed[v], p.pushes, dict(clients[v])) for v, p in kept.items()})
        oldest = min(item.enqueued for item in batch)
        try:
            head = self._forward(forward, time.monotonic() - oldest)
        except (ReducerStoppedError, ConnectionError, KeyError) as exc:
            if self.health.error is not None or not self.queue.closed:
                raise  # a failure (the co-located primary's, or the transport's): booked as dropped_error
            # shutting down and the primary is gone or stopped first: booked, and said out loud
            lost = forward_clients(forward)
            logger.warning(
                "gradient server %r: the primary %r stopped before the secondary %r; dropping a final "
                "bundle of %d pushes (%r). Stop the secondaries before the primary.",
                self.config.server_name,
                self.config.primary_reducer,
                self.config.me,
                sum(lost.values()),
                exc,
            )
            return "dropped_shutdown", lost
        with self._lock:
            self.forwarded += 1
            self._known_head = max(self._known_head, int(head))
        return None


def _push(index: int, entry: object) -> Queued:
    """A checkpointed pending push, validated; the message names ``pending[index]``."""
    if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and isinstance(entry[1], Packed)):
        raise ValueError(
            f"secondary pending[{index}] must be [version, packed gradients, client], got {entry!r:.200}"
        )
    version = check_int(f"secondary pending[{index}] version", entry[0])
    return Queued(version, entry[1], time.monotonic(), str(entry[2]))
