"""The RPC layer's backend seam: what ``RpcGroup`` and ``RemoteRef`` need from an RPC backend.

A World owns one backend, started with it and shut down by :meth:`World.stop`; the groups reach it through
their World (``GroupHost.rpc_agent``) and never start or stop it themselves. A backend carries calls
between the World's members, addressed by member name:

- **call** a module-level function on a member and get its return value back: blocking (:meth:`call_sync`),
  as a future (:meth:`call`), or kept on the member behind a reference (:meth:`remote`);
- **time out**: every call is bounded by its ``timeout``, then fails with ``TimeoutError`` naming the member,
  whatever the backend's own threads do: also while every thread that runs handlers (or completes replies)
  waits for calls of its own, as in a chain of nested calls deeper than the member's pool;
- **detect a dead member**: a call to a member that died or became unreachable fails within its timeout,
  with ``ConnectionError`` or ``TimeoutError`` naming it;
- **shut down** gracefully (outstanding work of the peers finishes first) or at once, always bounded.

What a call runs on the member is the RPC layer's own (``_remote``): a target that never raises and returns an
envelope, so the remote exception and its traceback travel as a value and the caller re-raises it with its
original type. A backend only carries values. Transport failures may surface as the backend's own error
types: ``TimeoutError``/``ConnectionError``, or torch's ``RuntimeError``/``OSError``, which the RPC layer
maps with :func:`pc_distributed._torch_errors.peer_error`; a payload that cannot be pickled raises
(``TypeError``, ``AttributeError`` or ``pickle.PicklingError``) before anything is sent.

A backend is a class (:class:`BackendType`) with a name and a ``start`` that takes one
:class:`BackendSetup`: everything the World knows that a backend may need to start (who this member is, the
members by rank, the timeouts, and the two meeting places on the World's store, made only when asked for,
since making them opens connections or serves a store). A started backend is used only through
:class:`RpcBackend`.
Implementations: ``_tensorpipe`` (``torch.distributed.rpc`` over TensorPipe) and ``_c10d`` (a gloo process
group per pair of members, with pc-pickle); ``_backends`` names them and resolves the World's ``rpc_backend``
argument to one of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["BackendSetup", "BackendType", "RemoteValue", "RpcBackend"]


@dataclass(frozen=True)
class BackendSetup:
    """What a World hands the ``start`` of its backend: one object, whatever the backend.

    Args:
        member: This process's member name (what calls address it by).
        rank: Its rank.
        world_size: Number of members.
        names: The members' names, by rank.
        timeout: Default seconds of a call (the World's ``rpc_timeout``).
        start_timeout: Seconds for the start-up, rendezvous included (the World's ``dist_timeout``).
        busy_poll: Whether the backend may use transports that busy-poll (the World's ``rpc_busy_poll``).
        link_store: Makes a store client scoped to this World for links made on the store (a new connection:
            call it only when the backend uses it).
        rpc_init_method: Makes the init method of ``torch.distributed.rpc`` (the World's store, or the store
            of RPC's own that rank 0 serves: call it only when the backend uses it).
    """

    member: str
    rank: int
    world_size: int
    names: Sequence[str]
    timeout: float
    start_timeout: float
    busy_poll: bool
    link_store: Callable[[], Any]
    rpc_init_method: Callable[[], str]


class RemoteValue(Protocol):
    """A value kept by its owner, as :meth:`RpcBackend.remote` returns it (a torch ``RRef`` on TensorPipe)."""

    def to_here(self, timeout: float = ...) -> Any:
        """Fetch a copy of the value within ``timeout`` seconds (left out: the backend's default)."""

    def is_owner(self) -> bool:
        """Whether this process keeps the value."""

    def owner(self) -> Any:
        """The backend's description of the owner (TensorPipe: torch's ``WorkerInfo``)."""

    def confirmed_by_owner(self) -> bool:
        """Whether the owner has confirmed the reference (a backend that creates it synchronously: True)."""


class RpcBackend(Protocol):
    """What a World's RPC groups call through (its RPC agent): calls to members by name, and shutdown.

    ``fn`` is called on member ``to`` as ``fn(*args, **kwargs)``; ``kwargs`` None means none. See the module
    docstring for the errors.
    """

    @property
    def name(self) -> str:
        """The backend's name (``"tensorpipe"``)."""

    def plain_pickles(self, value: Any) -> bool:
        """Whether the backend's pickler carries ``value`` as it is (else it travels as pc-pickle's bytes).

        The RPC targets ask this of every result: a backend that carries what plain pickle refuses answers
        True without looking.
        """

    def call_sync(
        self,
        to: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        timeout: float,
    ) -> Any:
        """Run ``fn`` on ``to`` and return its value, waiting at most ``timeout`` seconds."""

    def call(
        self,
        to: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        timeout: float,
    ) -> torch.futures.Future[Any]:
        """Run ``fn`` on ``to``; a future of its value, completed within ``timeout`` seconds."""

    def remote(
        self,
        to: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        timeout: float,
    ) -> RemoteValue:
        """Run ``fn`` on ``to``, which keeps the value; a reference to it, returned at once."""

    def shutdown(self, graceful: bool, timeout: float) -> None:
        """Stop within ``timeout`` seconds; ``graceful``: let the peers' outstanding work finish first.

        A graceful shutdown that fails falls back to a non-graceful one (with a ``RuntimeWarning``).
        """


class BackendType(Protocol):
    """A backend class as ``_backends`` registers it: its name, whether this torch has it, its start."""

    @property
    def name(self) -> str:
        """The name ``rpc_backend`` selects it by (``"c10d"``)."""

    def missing(self) -> str | None:
        """Why this torch build cannot run the backend (``"this torch build has no ..."``), or None."""

    def start(self, setup: BackendSetup) -> RpcBackend:
        """Start this member's backend (every member of the World calls it at the same time).

        Raises:
            TimeoutError: If the start-up does not finish within ``setup.start_timeout`` (plus a grace).
        """
