"""The c10d RPC backend: the :class:`~.transport.C10dTransport` as an RPC backend.

It is a :class:`~pc_distributed.rpc._backend.RpcBackend` that addresses members by name (the transport by
rank) and is started (``_backends``) on links it makes through the World's store: a gloo process group per
pair of members (:func:`pc_distributed._torch_dist.pair_link`), never ``torch.distributed.rpc``. Its remote
values are :class:`~.ref.C10dRemoteRef`. Errors are already the RPC layer's (``TimeoutError``/
``ConnectionError`` naming the member, ``TypeError`` for a payload that cannot be pickled), since the
transport pickles with pc-pickle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pc_distributed import _torch_dist
from pc_distributed._bounded import call_bounded
from pc_distributed.rpc._backend import BackendSetup
from pc_distributed.rpc._c10d.ref import C10dRemoteRef
from pc_distributed.rpc._c10d.transport import C10dTransport

__all__ = ["C10dBackend"]


class C10dBackend:
    """RPC over a gloo link per pair of members, with pc-pickle (see :mod:`~.transport`).

    Create it with :meth:`start`; each member of the World starts one.
    """

    name = "c10d"

    def __init__(self, transport: C10dTransport) -> None:
        self._transport = transport
        self._rank_of = {name: rank for rank, name in enumerate(transport.names)}

    @staticmethod
    def missing() -> str | None:
        """None: the backend needs only gloo, which every torch build the package supports has."""
        return None

    @classmethod
    def start(cls, setup: BackendSetup) -> C10dBackend:
        """Make the links to every other member on the World's store and start the transport.

        Every member calls it at the same time. The links are made in one global order of pairs, so no two
        members wait on each other; all of them together must be made within ``setup.start_timeout`` seconds,
        which is also gloo's timeout of every wait on them (a peer silent this long is lost). Calls default
        to ``setup.timeout`` seconds. The links meet on ``setup.link_store()`` (keys ``link/<a>-<b>/...``).

        Raises:
            TimeoutError: If a peer does not arrive in time.
        """
        store = setup.link_store()
        names, rank, timeout, link_timeout = list(setup.names), setup.rank, setup.timeout, setup.start_timeout
        others = [r for r in range(len(names)) if r != rank]

        def make_links() -> dict[int, Any]:
            devices = _torch_dist.link_devices()  # one event loop for all the links, where torch allows
            return {
                other: _torch_dist.pair_link(store, rank, other, link_timeout, devices) for other in others
            }

        what = f"the c10d links of member {names[rank]!r} to {[names[r] for r in others]}"
        try:
            links = call_bounded(make_links, link_timeout, what) if others else {}
        except RuntimeError as exc:  # gloo's own rendezvous timeout
            raise TimeoutError(f"{what} were not made within {link_timeout:g} s: {exc}") from exc
        return cls(C10dTransport(links, rank, names, timeout=timeout, link_timeout=link_timeout))

    def _rank(self, to: str) -> int:
        try:
            return self._rank_of[to]
        except KeyError:
            raise ValueError(f"no member named {to!r}; members are {sorted(self._rank_of)}") from None

    def plain_pickles(self, value: Any) -> bool:
        """Always True: the transport's pickler carries what plain pickle refuses by value itself."""
        return True

    def call_sync(
        self,
        to: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        timeout: float,
    ) -> Any:
        """Run ``fn`` on ``to`` and return its value, within ``timeout`` seconds."""
        return self._transport.call_sync(self._rank(to), fn, args, kwargs, timeout)

    def call(
        self,
        to: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        timeout: float,
    ) -> torch.futures.Future[Any]:
        """Run ``fn`` on ``to``; a future of its value, completed within ``timeout`` seconds."""
        return self._transport.call(self._rank(to), fn, args, kwargs, timeout)

    def remote(
        self,
        to: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        timeout: float,
    ) -> C10dRemoteRef:
        """Run ``fn`` on ``to``, which keeps the value until the reference is released or collected."""
        return self._transport.remote(self._rank(to), fn, args, kwargs, timeout)

    def shutdown(self, graceful: bool, timeout: float) -> None:
        """Say goodbye to every member within ``timeout`` (``graceful``: let calls in flight finish first)."""
        self._transport.shutdown(timeout, drain=graceful)

    def __repr__(self) -> str:
        return f"C10dBackend(member={self._transport.names[self._transport.rank]!r})"
