"""The gradient server's wire protocol: the messages between clients and reducers, and where they go.

::

    client    --GradMessage------------------->  <server>/<member>/_push_service     (each secondary)
    client    --(no arguments)---------------->  <server>/<member>/_ledger_service   (every reducer)
    secondary --(Forward or Done, age)-------->  <server>/<member>/_forward_service  (the primary)

Each message kind has a service of its own, so a reducer never dispatches on a number. Both ends of the
tree import this module and nothing of each other: the client and the reducers agree on these types only.
"""

from __future__ import annotations

from typing import NamedTuple

from pc_server._packing import Packed

__all__ = [
    "REDUCE_MASTER",
    "REDUCE_SLAVE",
    "Done",
    "Forward",
    "GradMessage",
    "forward_service_name",
    "ledger_service_name",
    "reducer_service_name",
]

REDUCE_MASTER = 0
"""The service level of a forward from a secondary reducer to the primary (a public compatibility name).

pc dispatches by service, not by level: a forward is a :class:`Forward` sent to the primary's forward
service, and no message carries this number.
"""
REDUCE_SLAVE = 1
"""The service level of a client push to a secondary reducer (a public compatibility name).

pc dispatches by service, not by level: the push service takes the :class:`GradMessage` alone, and accepts
this number as an optional second argument so that the compatible call shape ``(message, REDUCE_SLAVE)``
works.
"""


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


def ledger_service_name(server_name: str, member: str) -> str:
    """The ledger service key of ``member``'s reducer: ``<server_name>/<member>/_ledger_service``."""
    return f"{server_name}/{member}/_ledger_service"


def forward_service_name(server_name: str, member: str) -> str:
    """The forward service key of the primary ``member``: ``<server_name>/<member>/_forward_service``."""
    return f"{server_name}/{member}/_forward_service"
