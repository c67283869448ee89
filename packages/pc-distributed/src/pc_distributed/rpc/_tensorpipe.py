"""The TensorPipe RPC backend: ``torch.distributed.rpc``'s public calls as a :class:`~._backend.RpcBackend`.

Start-up and shutdown (TensorPipe's options, the bounded ``init_rpc``, the graceful shutdown with a fallback)
are torch-facing and live in :mod:`pc_distributed._torch_dist`; the calls themselves are torch's public
``rpc_sync``, ``rpc_async`` and ``remote``, looked up on ``torch.distributed.rpc`` at each call. A remote
value is torch's ``RRef``.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.rpc as rpc

from pc_distributed import _torch_dist

__all__ = ["TensorPipeBackend"]


class TensorPipeBackend:
    """RPC over ``torch.distributed.rpc`` with TensorPipe: the process-wide RPC agent of torch.

    Create it with :meth:`start` (one per process: torch's agent is global). Errors are torch's:
    ``RuntimeError`` for a timeout or a lost peer (the RPC layer maps them by message), pickling errors of
    the payload raised by the call itself.
    """

    name = "tensorpipe"

    @classmethod
    def start(
        cls,
        member: str,
        rank: int,
        world_size: int,
        url: str,
        timeout: float,
        start_timeout: float,
        busy_poll: bool = False,
    ) -> TensorPipeBackend:
        """Start torch's RPC as ``member`` on the rendezvous ``url``, within ``start_timeout`` seconds.

        Args:
            member: This process's member name (the name calls address it by).
            rank: Its rank.
            world_size: Number of processes.
            url: RPC's init method (the World's store, multi-tenant).
            timeout: Default seconds of a call.
            start_timeout: Seconds for the start-up (plus ``WAIT_GRACE``).
            busy_poll: Offer TensorPipe's busy-polling transports (see ``_torch_dist.rpc_options``).

        Raises:
            TimeoutError: If the start-up does not finish in time.
        """
        _torch_dist.start_rpc(member, rank, world_size, url, timeout, start_timeout, busy_poll)
        return cls()

    def plain_pickles(self, value: Any) -> bool:
        """Whether torch's RPC pickler takes ``value``: plain pickle, with tensors and RRefs set aside.

        One pickling pass over the value with its tensors left out (no tensor bytes are copied).
        """
        try:
            _Probe(io.BytesIO()).dump(value)
        except Exception:
            return False
        return True

    def call_sync(
        self,
        to: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        timeout: float,
    ) -> Any:
        """``rpc.rpc_sync`` of ``fn`` on ``to``."""
        return rpc.rpc_sync(to, fn, args=args, kwargs=kwargs, timeout=timeout)

    def call(
        self,
        to: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        timeout: float,
    ) -> torch.futures.Future[Any]:
        """``rpc.rpc_async`` of ``fn`` on ``to``."""
        future: torch.futures.Future[Any] = rpc.rpc_async(to, fn, args=args, kwargs=kwargs, timeout=timeout)
        return future

    def remote(
        self,
        to: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        timeout: float,
    ) -> Any:
        """``rpc.remote`` of ``fn`` on ``to``: torch's ``RRef`` (a :class:`~._backend.RemoteValue`)."""
        return rpc.remote(to, fn, args=args, kwargs=kwargs, timeout=timeout)

    def shutdown(self, graceful: bool, timeout: float) -> None:
        """Shut torch's RPC down within ``timeout`` (a failed graceful shutdown warns and falls back)."""
        _torch_dist.shutdown_rpc(graceful, timeout)

    def __repr__(self) -> str:
        return "TensorPipeBackend()"


class _Probe(pickle.Pickler):
    """Plain pickle that leaves out what torch's RPC pickler sends its own way (tensors, RRefs)."""

    def persistent_id(self, obj: Any) -> int | None:
        return 0 if isinstance(obj, (torch.Tensor, rpc.RRef)) else None
