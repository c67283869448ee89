"""The gradient server's checkpoint: what one reducer process writes and reads back.

Layout (``torch.save``-able)::

    {"format": "pc_server.PushPullGradServerImpl", "format_version": 1,
     "server_name": ..., "model_name": ..., "member": <the process that wrote it>,
     "primary":   {"version", "steps", "model", "optimizer", "lr_scheduler",
                   "pending": [{version: [packed sums, pushes, {client: pushes}]}, ...]} or None,
     "secondary": {"dedup": {client: [seq, accepted]}, "head",
                   "pending": [[version, packed gradients, client], ...]} or None,
     "ledger":    {"total": {...}, "clients": {client: {...}}}}

``pending`` holds what the process had accepted and not yet passed on (queued, or taken into the batch being
reduced): a checkpoint of a running server is taken under the step lock and the ledger's lock, so each push
the ledger counts as accepted here is either booked (applied or dropped) or in ``pending``, and a restored
server re-queues ``pending`` when it starts. Checkpoints written before ``pending`` existed load as if it were
empty. The primary also records ``optimizer_type`` and ``lr_scheduler_type`` (``module.QualName``); a
checkpoint without them is checked by its keys alone.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

from pc_server._checkpoint import check_state, header
from pc_server.grad._primary_reducer import PrimaryReducer
from pc_server.grad._protocol import Forward
from pc_server.grad._reducer_base import Queued, forward_clients
from pc_server.grad._secondary_reducer import SecondaryReducer
from pc_server.grad.config import GradServerConfig
from pc_server.grad.ledger import GradLedger, LedgerBook

__all__ = ["GRAD_FORMAT", "GradCheckpoint"]

GRAD_FORMAT = "pc_server.PushPullGradServerImpl"


class GradCheckpoint:
    """The checkpoint of one reducer process: what the facade's ``state_dict``/``load_state_dict`` do.

    The facade builds it once over the parts a checkpoint covers. It keeps the ledger as the last load left
    it, so that a load which would erase pushes booked since is refused.

    Args:
        config: The server's settings.
        ledger: The process's ledger.
        primary: The primary role of this process, if any.
        secondary: The secondary role of this process, if any.
    """

    def __init__(
        self,
        config: GradServerConfig,
        ledger: LedgerBook,
        primary: PrimaryReducer | None,
        secondary: SecondaryReducer | None,
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.primary = primary
        self.secondary = secondary
        self._loaded = GradLedger()  # the ledger as the last load() left it (empty before any)

    def state(self) -> dict[str, Any]:
        """The checkpoint of this reducer process (see the module docstring).

        On the primary the step lock is held throughout, so the ledger's applied counts match the model's
        step; the ledger's lock is held too, so no push moves between a queue and the ledger meanwhile.

        Raises:
            RuntimeError: On the primary, no model is managed yet.
        """
        primary, secondary, ledger = self.primary, self.secondary, self.ledger
        with primary.step_lock if primary is not None else contextlib.nullcontext(), ledger.lock:
            return {
                **header(GRAD_FORMAT),
                "server_name": self.config.server_name,
                "model_name": self.config.model_name,
                "member": self.config.me,
                "primary": primary.state() if primary is not None else None,
                "secondary": secondary.state() if secondary is not None else None,
                "ledger": ledger.state(),
            }

    def load(self, state: object) -> None:
        """Validate all of ``state`` against this process's roles and managed objects, then restore it.

        Nothing changes unless the whole checkpoint fits: the envelope, the ledger (and whether it agrees with
        the held pushes), the secondary's part and the primary's (model keys and shapes, optimizer and
        scheduler type and keys) are checked first. Loading replaces the state: the held pushes a previous
        load queued are replaced too, so loading the same checkpoint twice equals loading it once.

        Args:
            state: The checkpoint.

        Raises:
            TypeError: ``state`` is not a dict, or its optimizer or scheduler is of another type.
            ValueError: Another server's or role's checkpoint, or an entry that does not fit (named).
            RuntimeError: On the primary, no model is managed yet; pushes were booked since the last load (or
                since the server was built); or the restored version was refused (then the managed objects
                are as before).
        """
        config, primary, secondary, ledger = self.config, self.primary, self.secondary, self.ledger
        state = check_state(
            state, GRAD_FORMAT, ("server_name", "model_name", "primary", "secondary", "ledger")
        )
        for key in ("server_name", "model_name"):
            if state[key] != getattr(config, key):
                raise ValueError(
                    f"gradient server state_dict has {key} {state[key]!r}, "
                    f"this server has {getattr(config, key)!r}"
                )
        writer = state.get("member")
        for role, mine in (("primary", primary), ("secondary", secondary)):
            if (state[role] is None) != (mine is None):
                raise ValueError(
                    f"gradient server {config.server_name!r}: the state_dict was written by {writer!r}, "
                    f"{'not ' if state[role] is None else ''}a {role} reducer, but {config.me!r} is "
                    f"{'' if mine is not None else 'not '}one; load each reducer's own checkpoint"
                )
        if primary is not None and primary.model is None:
            raise RuntimeError("call manage_model() before load_state_dict(): the primary holds no model yet")
        if ledger.snapshot() != self._loaded:
            raise RuntimeError(
                f"gradient server {config.server_name!r}: {config.me!r} booked pushes since it was built or "
                "last loaded; loading now would erase them. Load before clients push."
            )
        probe = LedgerBook()
        probe.load(state["ledger"])
        restore_secondary, held = (
            secondary.check_load(state["secondary"]) if secondary is not None else (None, [])
        )
        load_primary, bundles = primary.check_load(state["primary"]) if primary is not None else (None, [])
        _check_held(config, probe.snapshot(), held, bundles)
        # everything fits: load (the primary's part puts its objects back and raises if it fails)
        if load_primary is not None:
            load_primary()
        with ledger.lock:
            ledger.load(state["ledger"])
            if secondary is not None and restore_secondary is not None:
                restore_secondary()
                secondary.restore_pending(held)
            if primary is not None:
                primary.restore_pending(bundles)
        self._loaded = ledger.snapshot()


def _check_held(
    config: GradServerConfig, ledger: GradLedger, held: list[Queued], bundles: list[tuple[Forward, float]]
) -> None:
    """Check that the ledger accounts for the held pushes (as far as one process's ledger can tell).

    A process that is the server's only reducer books every push it holds as pending; a secondary that is
    not the primary holds at most the pushes its ledger counts as pending (the rest it forwarded).

    Raises:
        ValueError: A client whose held pushes the ledger does not account for (named).
    """
    counts: Counter[str] = Counter(item.client for item in held)
    for forward, _age in bundles:
        counts.update(forward_clients(forward))
    pending = {c: n.pending for c, n in ledger.clients.items()}
    sole = config.is_primary and config.secondary_reducers == (config.me,)
    for client in sorted(counts.keys() | ({c for c, n in pending.items() if n} if sole else set())):
        have, booked = counts[client], pending.get(client, 0)
        if (have != booked) if sole else (not config.is_primary and have > booked):
            raise ValueError(
                f"gradient server {config.server_name!r}: the checkpoint holds {have} pushes of client "
                f"{client!r} but its ledger counts {booked} pending"
            )
