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
empty.
"""

from __future__ import annotations

import contextlib
from typing import Any

from pc_server._checkpoint import check_state, header
from pc_server._primary_reducer import PrimaryReducer
from pc_server._secondary_reducer import SecondaryReducer
from pc_server.grad_config import GradServerConfig
from pc_server.ledger import LedgerBook

__all__ = ["GRAD_FORMAT", "grad_state", "load_grad_state"]

GRAD_FORMAT = "pc_server.PushPullGradServerImpl"


def grad_state(
    config: GradServerConfig,
    primary: PrimaryReducer | None,
    secondary: SecondaryReducer | None,
    ledger: LedgerBook,
) -> dict[str, Any]:
    """The checkpoint of one reducer process (see the module docstring).

    On the primary the step lock is held throughout, so the ledger's applied counts match the model's step;
    the ledger's lock is held too, so no push moves between a queue and the ledger meanwhile.
    """
    with primary.step_lock if primary is not None else contextlib.nullcontext(), ledger.lock:
        return _state(config, primary, secondary, ledger)


def _state(
    config: GradServerConfig,
    primary: PrimaryReducer | None,
    secondary: SecondaryReducer | None,
    ledger: LedgerBook,
) -> dict[str, Any]:
    return {
        **header(GRAD_FORMAT),
        "server_name": config.server_name,
        "model_name": config.model_name,
        "member": config.me,
        "primary": primary.state() if primary is not None else None,
        "secondary": secondary.state() if secondary is not None else None,
        "ledger": ledger.state(),
    }


def load_grad_state(
    config: GradServerConfig,
    primary: PrimaryReducer | None,
    secondary: SecondaryReducer | None,
    ledger: LedgerBook,
    state: object,
) -> None:
    """Validate ``state`` against this process's roles, then restore it.

    The secondary's part and the ledger are validated before anything changes; the primary's part is loaded
    into the managed objects (its errors name the part that does not fit), then the secondary's and the
    ledger are restored.

    Raises:
        TypeError: ``state`` is not a dict, or holds state a managed object cannot load.
        ValueError: Another server's or role's checkpoint, or a malformed entry (named in the message).
        RuntimeError: On the primary, no model is managed yet, or the restored version was refused.
    """
    state = check_state(state, GRAD_FORMAT, ("server_name", "model_name", "primary", "secondary", "ledger"))
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
    probe = LedgerBook()
    probe.load(state["ledger"])  # validated before anything changes
    restore_secondary = secondary.load(state["secondary"]) if secondary is not None else None  # validates
    if primary is not None:
        primary.load(state["primary"])
    if restore_secondary is not None:
        restore_secondary()
    ledger.load(state["ledger"])
