"""How torch's failures are read: as ``TimeoutError`` or ``ConnectionError`` naming the peer.

The error raised is chained to torch's. The two are told apart by type where torch gives one
(``TimeoutError``, ``ConnectionError``, ``torch.distributed.DistNetworkError``); torch's RPC agent raises a
plain ``RuntimeError`` for both a timeout and a lost peer, and for it only the message tells them apart, so
words of the message are matched as the fallback (:data:`TIMEOUT_WORDS`, :data:`CONNECTION_WORDS`). One
refusal of the agent is bad input, not a lost peer: a CUDA tensor in a call on TensorPipe without device maps
(pc sets none). Its text (:data:`CPU_ONLY_WORDS`) would match ``"pipe"``; it becomes a ``ValueError`` that
says which backend carries CUDA tensors.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = [
    "CONNECTION_WORDS",
    "CPU_ONLY_WORDS",
    "TIMEOUT_WORDS",
    "is_connection_loss",
    "is_timeout",
    "peer_error",
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


def peer_error(exc: BaseException, target: str, what: str) -> BaseException:
    """Map a failure of torch's transport to ``TimeoutError``/``ConnectionError`` naming the target.

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
