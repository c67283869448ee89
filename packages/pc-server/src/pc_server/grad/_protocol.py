"""The gradient server's wire protocol: the messages between clients and reducers, and where they go.

::

    client    --(GradMessage, REDUCE_SLAVE)--->  <server>/<member>/_push_service     (a secondary)
    client    --(None, LEDGER_LEVEL)---------->  <server>/<member>/_push_service     (any reducer)
    secondary --Forward, then Done at stop---->  the primary's receiver               (by member name)

Both ends of the tree import this module and nothing of each other: the client and the reducers agree on
these types only.
"""

from __future__ import annotations

from typing import NamedTuple

from pc_server._packing import Packed

__all__ = [
    "LEDGER_LEVEL",
    "REDUCE_MASTER",
    "REDUCE_SLAVE",
    "Done",
    "Forward",
    "GradMessage",
    "reducer_service_name",
]

REDUCE_MASTER = 0
"""Service level of a forward from a secondary reducer to the primary (a public compatibility name)."""
REDUCE_SLAVE = 1
"""Service level of a client push to a secondary reducer (a public compatibility name)."""
LEDGER_LEVEL = 2
"""Service level of a ledger request (the reducer answers with its :class:`~pc_server.GradLedger`)."""


class GradMessage(NamedTuple):
    """One client push as sent to a secondary reducer.

    Attributes:
        grads: The packed gradients, keyed by ``named_parameters`` names.
        client: A per-accessor identity (``"<process>/<random hex>"``).
        seq: The push's sequence number for this client (1, 2, ...); duplicates are ignored.
        version: The ``pp_version`` of the model the gradients were computed on.
    """

    grads: Packed
    client: str
    seq: int
    version: int


class Forward(NamedTuple):
    """A secondary's bundle: version -> (packed gradient sums, push count, pushes per client)."""

    partials: dict[int, tuple[Packed, int, dict[str, int]]]


class Done(NamedTuple):
    """A secondary's last message from ``stop()``: it forwarded everything it held."""

    member: str


def reducer_service_name(server_name: str, member: str) -> str:
    """The push service key of ``member``'s reducer: ``<server_name>/<member>/_push_service``."""
    return f"{server_name}/{member}/_push_service"
