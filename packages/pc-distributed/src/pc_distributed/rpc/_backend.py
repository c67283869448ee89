"""The RPC layer's transport seam: what ``RpcGroup`` and ``RemoteRef`` need from an RPC backend.

A World owns one backend, started with it and shut down by :meth:`World.stop`; the groups reach it through
their World (``GroupHost.rpc_transport``) and never call a transport themselves. A backend carries calls
between the World's members, addressed by member name:

- **call** a module-level function on a member and get its return value back: blocking (:meth:`call_sync`),
  as a future (:meth:`call`), or kept on the member behind a reference (:meth:`remote`);
- **time out**: every call is bounded by its ``timeout``, then fails with ``TimeoutError`` naming the member,
  whatever the transport's own threads do: also while every thread that runs handlers (or completes replies)
  waits for calls of its own, as in a chain of nested calls deeper than the member's pool;
- **detect a dead member**: a call to a member that died or became unreachable fails within its timeout,
  with ``ConnectionError`` or ``TimeoutError`` naming it;
- **shut down** gracefully (outstanding work of the peers finishes first) or at once, always bounded.

What a call runs on the member is the RPC layer's own (``_remote``): a target that never raises and returns an
envelope, so the remote exception and its traceback travel as a value and the caller re-raises it with its
original type. A backend only carries values. Transport failures may surface as the backend's own error
types: ``TimeoutError``/``ConnectionError``, or torch's ``RuntimeError``/``OSError``, which the RPC layer
maps with :func:`pc_distributed._transport.transport_error`; a payload that cannot be pickled raises
(``TypeError``, ``AttributeError`` or ``pickle.PicklingError``) before anything is sent.

Starting a backend is the World's, per backend (each needs different things: a rendezvous URL, links made on
the store); a started backend is used only through this protocol. Implementations: ``_tensorpipe``
(``torch.distributed.rpc`` over TensorPipe) and ``_c10d`` (a gloo process group per pair of members, with
pc-pickle). :func:`choose_backend` resolves the World's ``rpc_backend`` argument to one of them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

import torch

from pc_distributed import _torch_dist

__all__ = ["AUTO_CHOICE", "BACKENDS", "ENV_VAR", "RemoteValue", "RpcBackend", "choose_backend"]

BACKENDS = ("tensorpipe", "c10d")
ENV_VAR = "PC_RPC_BACKEND"
"""The environment variable that ``rpc_backend="auto"`` reads first (``tensorpipe`` or ``c10d``)."""
AUTO_CHOICE = "tensorpipe"
"""What ``auto`` picks when torch has RPC and the variable is unset (docs/distributed.md says why)."""


def choose_backend(requested: object) -> str:
    """The backend a World uses for ``rpc_backend=requested``.

    ``"tensorpipe"`` and ``"c10d"`` are taken as given (TensorPipe only where this torch build has
    ``torch.distributed.rpc``). ``"auto"`` is :data:`ENV_VAR` if set, else ``"c10d"`` on a torch without RPC,
    else :data:`AUTO_CHOICE`.

    Raises:
        TypeError: If ``requested`` is not a str.
        ValueError: If it (or the variable) names no backend, or names TensorPipe on a torch without RPC.
    """
    if not isinstance(requested, str):
        raise TypeError(f"rpc_backend must be a str, got {type(requested).__name__}")
    choice, source = requested.lower(), f"rpc_backend {requested!r}"
    if choice == "auto":
        from_env = os.environ.get(ENV_VAR, "").strip().lower()
        if from_env:
            choice, source = from_env, f"{ENV_VAR}={os.environ[ENV_VAR]!r}"
        else:
            choice = AUTO_CHOICE if _torch_dist.rpc_available() else "c10d"
    if choice not in BACKENDS:
        raise ValueError(f"{source}: expected one of {[*BACKENDS, 'auto']}")
    if choice == "tensorpipe" and not _torch_dist.rpc_available():
        raise ValueError(f"{source}: this torch build has no torch.distributed.rpc; use 'c10d' or 'auto'")
    return choice


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
    """The transport of a World's RPC groups: calls to members by name, with timeouts, and shutdown.

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
