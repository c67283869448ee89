"""How an RPC group's call reaches its target: the send with mapped transport errors, and the owner retry.

:func:`call_owner` (``registered_async``) and :func:`call_owner_sync` (``registered_sync``) take the same
path: ask the cached owner first; if it answers "missing" (a stale cache entry), look the owner up again and
try once more. The blocking one waits in the caller's thread (as a raw ``rpc_sync`` does) instead of
chaining a second future whose callback runs on an RPC thread: one hand-off less on the hot path.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from pc_distributed._host import GroupHost
from pc_distributed._transport import transport_error, with_cause
from pc_distributed.rpc._remote import MissingOnOwner, unwrap

__all__ = ["call_owner", "call_owner_sync", "invoke"]


def invoke(
    host: GroupHost,
    method: Callable[..., Any],
    to: str,
    func: Any,
    args: tuple[Any, ...],
    timeout: float,
    parts: Sequence[str] = (),
) -> Any:
    """Send one torch RPC (``rpc_sync``, ``rpc_async`` or ``remote``) to ``to`` with ``timeout`` seconds.

    Args:
        host: The World.
        method: Torch's ``rpc_sync``, ``rpc_async`` or ``remote``.
        to: The target member.
        func: The function torch runs there.
        args: Its arguments (the call's payload).
        timeout: Seconds.
        parts: What each element of ``args`` is (``"func"``, ``"args"``, ...), to name an unpicklable one.

    Raises:
        RuntimeError: If the World has no RPC.
        TypeError: If an element of ``args`` cannot be pickled; the message names it (``args[1]``) and
            pickle's error is the ``__cause__``.
        TimeoutError: If torch reports a timeout.
        ConnectionError: If torch reports a lost or refused connection.
    """
    if not host.init_rpc:
        raise RuntimeError("RPC calls need a World created with init_rpc=True")
    what = getattr(method, "__name__", "rpc")
    try:
        return method(to, func, args=args, timeout=timeout)
    except (RuntimeError, OSError) as exc:
        raise transport_error(exc, to, what) from exc
    except (AttributeError, TypeError, pickle.PicklingError) as exc:  # pickling the payload failed
        found = _unpicklable(args, parts)
        if found is None:
            raise
        where, obj = found
        kind = type(obj)
        raise TypeError(
            f"{what} to {to!r}: {where} cannot be pickled ({kind.__module__}.{kind.__qualname__}: {exc}); "
            "RPC sends functions by reference: pass a module-level function and picklable arguments"
        ) from exc


def _pickles(obj: Any) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:
        return False
    return True


def _unpicklable(payload: tuple[Any, ...], parts: Sequence[str]) -> tuple[str, Any] | None:
    """The first element of ``payload`` (one level into tuples, lists and dicts) that does not pickle."""
    for i, part in enumerate(payload):
        label = parts[i] if i < len(parts) else f"argument {i}"
        items: Iterable[tuple[Any, Any]] | None = None
        if isinstance(part, (tuple, list)):
            items = enumerate(part)
        elif isinstance(part, dict):
            items = part.items()
        if items is None:
            if not _pickles(part):
                return label, part
            continue
        for key, item in items:
            if not _pickles(item):
                return f"{label}[{key!r}]", item
    return None


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
