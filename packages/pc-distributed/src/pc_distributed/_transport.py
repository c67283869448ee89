"""The package's timeout convention, call-argument checks and the mapping of torch's transport errors.

**Timeouts.** Every ``timeout`` argument of pc-distributed means the same: ``None`` is the owner's default (an
RPC call: the World's ``rpc_timeout``; a group barrier: the World's ``rpc_timeout``; ``irecv().wait``: the
group's timeout; ``World.stop``: ``rpc_timeout``), any other value is a number of seconds > 0 and at most
``MAX_TIMEOUT`` (24 days; longer, infinite and NaN are a ``ValueError`` at the call). ``-1`` is accepted
everywhere as another name for ``None``, for code written against the original API. No wait of the package is
infinite, by default or on request. A call's timeout bounds the caller's whole wait on both RPC backends,
whatever the transport's threads do (calls nested deeper than a member's handler threads included: see
:mod:`pc_distributed.rpc._tensorpipe`). The checks themselves live in :mod:`pc_distributed._checks`.

**Transport errors.** Failures of the transport surface as ``TimeoutError`` or ``ConnectionError`` naming the
peer, chained to torch's error. They are told apart by type where torch gives one (``TimeoutError``,
``ConnectionError``, ``torch.distributed.DistNetworkError``); torch's RPC agent raises a plain
``RuntimeError`` for both a timeout and a lost peer, and for it only the message tells them apart, so words of
the message are matched as the fallback (:data:`TIMEOUT_WORDS`, :data:`CONNECTION_WORDS`). One refusal of
the agent is bad input, not a lost peer: a CUDA tensor in a call on TensorPipe without device maps (pc sets
none). Its text (:data:`CPU_ONLY_WORDS`) would match ``"pipe"``; it becomes a ``ValueError`` that says which
backend carries CUDA tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pc_distributed._checks import optional_timeout

__all__ = [
    "CONNECTION_WORDS",
    "CPU_ONLY_WORDS",
    "TIMEOUT_WORDS",
    "chain_future",
    "check_call_args",
    "is_connection_loss",
    "is_timeout",
    "resolve_timeout",
    "transport_error",
    "with_cause",
]

# Fallback only: words of torch's RuntimeError texts for a timeout and for a lost connection.
TIMEOUT_WORDS = ("timeout", "timed out")
CONNECTION_WORDS = (
    "connection",
    "pipe",
    "eof",
    "closed",
    "reset",
    "shut",
    "refused",
    "unreachable",
    "broken",
)

# TensorPipe's refusal of a CUDA tensor without device maps ("... only supports CPU tensors by default ...").
CPU_ONLY_WORDS = "only supports cpu tensors"

_DistNetworkError: type[BaseException] = getattr(dist, "DistNetworkError", ConnectionError)


def resolve_timeout(timeout: object, default: float) -> float:
    """Seconds of a wait: ``timeout`` if it is not the default (``None`` or ``-1``), else ``default``."""
    seconds = optional_timeout("timeout", timeout)
    return default if seconds is None else seconds


def is_timeout(exc: BaseException) -> bool:
    """Whether torch's error ``exc`` reports a timeout (by type; by message for a plain ``RuntimeError``)."""
    if isinstance(exc, TimeoutError):
        return True
    if isinstance(exc, (ConnectionError, _DistNetworkError)):
        return False
    low = str(exc).lower()
    return any(word in low for word in TIMEOUT_WORDS)


def is_connection_loss(exc: BaseException) -> bool:
    """Whether torch's error ``exc`` reports a lost or refused connection (not a timeout)."""
    if is_timeout(exc):
        return False
    if isinstance(exc, (ConnectionError, _DistNetworkError)):
        return True
    low = str(exc).lower()
    return any(word in low for word in CONNECTION_WORDS)


def transport_error(exc: BaseException, target: str, what: str) -> BaseException:
    """Map a torch transport failure to ``TimeoutError``/``ConnectionError`` naming the target.

    TensorPipe's refusal of a CUDA tensor becomes a ``ValueError`` (see the module); anything else that is
    neither a timeout nor a lost connection becomes a ``RuntimeError`` naming the target. The caller chains
    ``exc``.
    """
    text = str(exc)
    if CPU_ONLY_WORDS in text.lower():
        return ValueError(
            f"{what} to {target!r}: a CUDA tensor cannot travel on the TensorPipe RPC backend (pc sets no "
            "device maps); move it to the CPU first, or use World(rpc_backend='c10d') (run_world takes the "
            f"same keyword), which carries CUDA tensors through host memory. TensorPipe said: {text}"
        )
    if is_timeout(exc):
        return TimeoutError(f"{what} to {target!r} timed out: {text}")
    if isinstance(exc, (ConnectionError, _DistNetworkError)):
        return ConnectionError(f"{what} to {target!r} failed: {text}")
    low = text.lower()
    if any(word in low for word in CONNECTION_WORDS):
        return ConnectionError(f"{what} to {target!r} failed: {text}")
    return RuntimeError(f"{what} to {target!r} failed: {text}")


def check_call_args(args: object, kwargs: object) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Validate ``args``/``kwargs`` of a call and return them as a tuple and a dict.

    Raises:
        TypeError: If ``args`` is not a tuple or list, or ``kwargs`` not a dict or None.
    """
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict or None, got {type(kwargs).__name__}")
    return tuple(args), dict(kwargs or {})


def with_cause(exc: BaseException, cause: BaseException) -> BaseException:
    """Return ``exc`` with ``__cause__`` set to ``cause`` (for exceptions handed to futures)."""
    exc.__cause__ = cause
    return exc


def chain_future(
    raw: torch.futures.Future[Any], target: str, finish: Callable[[Any], Any]
) -> torch.futures.Future[Any]:
    """A future completed with ``finish(envelope)``, or its exception; transport errors are mapped."""
    out: torch.futures.Future[Any] = torch.futures.Future()

    def done(fut: torch.futures.Future[Any]) -> None:
        try:
            envelope = fut.wait()
        except (RuntimeError, OSError) as exc:
            out.set_exception(with_cause(transport_error(exc, target, "rpc_async"), exc))
            return
        try:
            out.set_result(finish(envelope))
        except Exception as exc:
            out.set_exception(exc)

    raw.add_done_callback(done)
    return out
