"""How an RPC group's call reaches its target: the send with mapped transport errors, and the owner retry.

:func:`call_owner` (``registered_async``) and :func:`call_owner_sync` (``registered_sync``) take the same
path: ask the cached owner first; if it answers "missing" (a stale cache entry), look the owner up again and
try once more. The blocking one waits in the caller's thread (as a raw ``rpc_sync`` does) instead of
chaining a second future whose callback runs on an RPC thread: one hand-off less on the hot path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pc_distributed._host import GroupHost
from pc_distributed._remote import MissingOnOwner, unwrap
from pc_distributed._transport import transport_error, with_cause

__all__ = ["call_owner", "call_owner_sync", "invoke"]


def invoke(
    host: GroupHost, method: Callable[..., Any], to: str, func: Any, args: tuple[Any, ...], timeout: float
) -> Any:
    """Send one torch RPC (``rpc_sync``, ``rpc_async`` or ``remote``) to ``to`` with ``timeout`` seconds.

    Raises:
        RuntimeError: If the World has no RPC.
        TimeoutError: If torch reports a timeout.
        ConnectionError: If torch reports a lost or refused connection.
    """
    if not host.init_rpc:
        raise RuntimeError("RPC calls need a World created with init_rpc=True")
    try:
        return method(to, func, args=args, timeout=timeout)
    except (RuntimeError, OSError) as exc:
        raise transport_error(exc, to, getattr(method, "__name__", "rpc")) from exc


def call_owner(
    owner_of: Callable[[bool], str | None],
    send: Callable[[str], torch.futures.Future[Any]],
    not_found: Callable[[], KeyError],
) -> torch.futures.Future[Any]:
    """Call a service on its owner, retrying once after a fresh look-up when the owner lost the key.

    Args:
        owner_of: ``owner_of(refresh)`` returns the owner's name (cached unless ``refresh``), or None.
        send: Sends the call to an owner; its future holds the owner's envelope.
        not_found: Makes the ``KeyError`` for a key no member holds.

    Returns:
        A future with the service's result, or its exception (the service's own, ``KeyError``,
        ``TimeoutError`` or ``ConnectionError``). Errors of the first look-up or send raise here instead.
    """
    out: torch.futures.Future[Any] = torch.futures.Future()

    def attempt(refresh: bool) -> None:
        owner = owner_of(refresh)
        if owner is None:
            out.set_exception(not_found())
            return

        def done(fut: torch.futures.Future[Any]) -> None:
            try:
                envelope = fut.wait()
            except (RuntimeError, OSError) as exc:
                out.set_exception(with_cause(transport_error(exc, owner, "rpc"), exc))
                return
            try:
                out.set_result(unwrap(envelope, f"process {owner!r}"))
            except MissingOnOwner:
                if refresh:
                    out.set_exception(not_found())
                    return
                try:
                    attempt(True)
                except Exception as exc:
                    out.set_exception(exc)
            except Exception as exc:
                out.set_exception(exc)

        send(owner).add_done_callback(done)

    attempt(False)
    return out


def call_owner_sync(
    owner_of: Callable[[bool], str | None],
    send: Callable[[str], Any],
    not_found: Callable[[], KeyError],
) -> Any:
    """Blocking :func:`call_owner`: the service's result, or its exception raised here.

    Args:
        owner_of: ``owner_of(refresh)`` returns the owner's name (cached unless ``refresh``), or None.
        send: Sends the call to an owner and returns the owner's envelope (transport errors mapped, e.g. by
            :func:`invoke` with ``rpc_sync``).
        not_found: Makes the ``KeyError`` for a key no member holds.

    Raises:
        KeyError: If no member holds the key (also after one fresh look-up).
        TimeoutError: If the owner did not answer in time.
        ConnectionError: If the owner is unreachable.
        Exception: The service's own exception.
    """
    for refresh in (False, True):
        owner = owner_of(refresh)
        if owner is None:
            break
        try:
            return unwrap(send(owner), f"process {owner!r}")
        except MissingOnOwner:
            continue  # a stale cache entry: look the owner up again, once
    raise not_found()
