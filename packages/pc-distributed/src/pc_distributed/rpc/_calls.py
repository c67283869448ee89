"""How an RPC group's call reaches its target: the send with torch's failures mapped, and a service call.

A call is sent through the World's RPC backend (:mod:`~._backend`), never to a backend's internals.

A :class:`ServiceCall` is one call of a registered service. Without a given owner it asks the cached owner
first; if that answers "missing" (a stale cache entry) it looks the owner up again and tries once more. With a
given owner it goes straight there and never asks the directory. The blocking form waits in the caller's
thread (as a raw ``rpc_sync`` does), and when the owner is this process it runs the service right here,
without an RPC to itself, on copies of the arguments and the result (:func:`~._remote.copy_by_either`), so
the caller sees what an RPC would have delivered.

A call whose function or arguments plain pickle refuses is sent again by value
(:func:`~._remote.call_by_value` with pc-pickle's bytes); only what neither can carry is a ``TypeError``.
Plain pickle goes first because torch's RPC pickler sends tensors beside the pickle, without copying them
into it.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch

import pc_pickle
from pc_distributed._errors import with_cause
from pc_distributed._host import GroupHost
from pc_distributed._torch_errors import peer_error
from pc_distributed.rpc._backend import RpcBackend
from pc_distributed.rpc._directory import Directory
from pc_distributed.rpc._remote import (
    OK,
    SERVICE,
    MissingOnOwner,
    call_by_value,
    call_service,
    copy_by_either,
    run_service,
    unwrap,
)
from pc_distributed.rpc.remote_ref import RemoteRef

__all__ = ["Send", "ServiceCall", "chain_future", "invoke", "pickling_error"]

# How a call is sent: the names are those of torch's functions, which errors have always named.
Send = Literal["rpc_sync", "rpc_async", "remote"]

# What the elements of a service call's payload are, to name an unpicklable one.
_SERVICE_PARTS = ("group", "key", "args", "kwargs")


def invoke(
    host: GroupHost,
    send: Send,
    to: str,
    func: Any,
    args: tuple[Any, ...],
    timeout: float,
    parts: Sequence[str] = (),
) -> Any:
    """Send one call to ``to`` with ``timeout`` seconds through the World's RPC backend.

    Args:
        host: The World.
        send: ``"rpc_sync"`` (the value), ``"rpc_async"`` (a future of it) or ``"remote"`` (a
            :class:`~._backend.RemoteValue`).
        to: The target member.
        func: The function the backend runs there.
        args: Its arguments (the call's payload).
        timeout: Seconds.
        parts: What each element of ``args`` is (``"func"``, ``"args"``, ...), to name an unpicklable one.

    Raises:
        RuntimeError: If the World has no RPC.
        TypeError: If an element of ``args`` can be pickled neither by plain pickle nor by value with
            pc-pickle (then the call is sent by value); the message names it (``args[1]``) and pickle's error
            is the ``__cause__``.
        TimeoutError: If the backend reports a timeout.
        ConnectionError: If the backend reports a lost or refused connection.
    """
    backend: RpcBackend | None = host.rpc_agent if host.init_rpc else None
    if backend is None:
        raise RuntimeError("RPC calls need a World created with init_rpc=True")
    method = {"rpc_sync": backend.call_sync, "rpc_async": backend.call, "remote": backend.remote}[send]
    try:
        return method(to, func, args, None, timeout)
    except (RuntimeError, OSError) as exc:
        raise peer_error(exc, to, send) from exc
    except (AttributeError, TypeError, pickle.PicklingError) as exc:  # plain pickle refused the payload
        refused = exc
    try:
        blob = pc_pickle.dumps((func, args))
    except Exception:
        raise pickling_error(refused, f"{send} to {to!r}", args, parts) from refused
    try:
        return method(to, call_by_value, (blob,), None, timeout)
    except (RuntimeError, OSError) as exc:
        raise peer_error(exc, to, send) from exc


def pickling_error(
    exc: BaseException, what: str, payload: tuple[Any, ...], parts: Sequence[str]
) -> BaseException:
    """The ``TypeError`` naming the element of ``payload`` that did not pickle (``exc`` itself if none did).

    What plain pickle refuses travels by value with pc-pickle, so the element named is one that neither can
    carry. The caller chains ``exc`` as the ``__cause__``.
    """
    found = _unpicklable(payload, parts)
    if found is None:
        return exc
    where, obj = found
    kind = type(obj)
    return TypeError(
        f"{what}: {where} can be pickled neither by pickle nor by value with pc-pickle "
        f"({kind.__module__}.{kind.__qualname__}: {exc})"
    )


def _pickles(obj: Any) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:
        try:
            pc_pickle.dumps(obj)
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


class ServiceCall:
    """One call of the service ``key`` of an RPC group: find its owner, send, retry once on a stale owner.

    Args:
        host: The World.
        directory: The group's directory (owner look-ups, cached).
        group: The group's name.
        key: The service's key, as the caller gave it (for the ``KeyError`` text).
        args: Positional arguments.
        kwargs: Keyword arguments.
        timeout: Seconds of each attempt's RPC.
        owner: The member known to own ``key`` (then the directory is not asked), or None.
    """

    def __init__(
        self,
        host: GroupHost,
        directory: Directory,
        group: str,
        key: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
        owner: str | None = None,
    ) -> None:
        self._host = host
        self._directory = directory
        self._group = group
        self._key = key
        self._ktext = repr(key)
        self._payload = (group, self._ktext, args, kwargs)
        self._timeout = timeout
        self._owner = owner

    def not_found(self) -> KeyError:
        """The ``KeyError`` for a key that no member (or not the given owner) holds."""
        where = "" if self._owner is None else f" (asked member {self._owner!r})"
        return KeyError(f"Service with key [{self._key}] not found on Group [{self._group}]{where}")

    def _owner_of(self, refresh: bool) -> str | None:
        if self._owner is not None:
            return self._owner
        return self._directory.owner(SERVICE, self._ktext, refresh)

    def _attempts(self) -> tuple[bool, ...]:
        # a given owner is asked once: there is no directory to correct it
        return (False,) if self._owner is not None else (False, True)

    def _send(self, send: Send, owner: str) -> Any:
        return invoke(self._host, send, owner, call_service, self._payload, self._timeout, _SERVICE_PARTS)

    def _run_here(self) -> Any:
        """Run the service in this process on copies of the arguments; return a copy of its result."""
        what = f"registered_sync of {self._ktext} in this process"
        try:
            group, ktext, args, kwargs = copy_by_either(self._payload)
        except (AttributeError, TypeError, pickle.PicklingError) as exc:
            raise pickling_error(exc, what, self._payload, _SERVICE_PARTS) from exc
        envelope = run_service(self._host.rpc_tables.get(group), ktext, args, kwargs)
        if envelope[0] != OK:
            return envelope
        try:
            return (OK, copy_by_either(envelope[1]))
        except (AttributeError, TypeError, pickle.PicklingError) as exc:
            raise pickling_error(exc, what, (envelope[1],), ("result",)) from exc

    def sync(self) -> Any:
        """The service's result, or its exception raised here.

        Raises:
            KeyError: If no member holds the key (also after one fresh look-up).
            TimeoutError: If the owner did not answer in time.
            ConnectionError: If the owner is unreachable.
            Exception: The service's own exception.
        """
        for refresh in self._attempts():
            owner = self._owner_of(refresh)
            if owner is None:
                break
            here = owner == self._host.name  # no RPC to itself
            envelope = self._run_here() if here else self._send("rpc_sync", owner)
            try:
                return unwrap(envelope, f"process {owner!r}")
            except MissingOnOwner:
                continue  # a stale cache entry: look the owner up again, once
        raise self.not_found()

    def future(self) -> torch.futures.Future[Any]:
        """A future with the service's result, or its exception (always one RPC, also to this process).

        Errors of the first look-up or send raise here instead.
        """
        out: torch.futures.Future[Any] = torch.futures.Future()
        attempts = self._attempts()

        def attempt(index: int) -> None:
            owner = self._owner_of(attempts[index])
            if owner is None:
                out.set_exception(self.not_found())
                return

            def relay(fut: torch.futures.Future[Any]) -> None:
                try:
                    out.set_result(fut.wait())
                except MissingOnOwner:  # the owner lost the service since the look-up: try the next
                    if index + 1 == len(attempts):
                        out.set_exception(self.not_found())
                        return
                    try:
                        attempt(index + 1)
                    except Exception as exc:
                        out.set_exception(exc)
                except Exception as exc:
                    out.set_exception(exc)

            sent = self._send("rpc_async", owner)
            chain_future(
                sent, owner, lambda envelope: unwrap(envelope, f"process {owner!r}"), "rpc"
            ).add_done_callback(relay)

        attempt(0)
        return out

    def remote(self) -> RemoteRef:
        """Run the service on its owner (one RPC); a :class:`RemoteRef` to the result.

        Raises:
            KeyError: If no member holds the key (the directory is asked afresh unless an owner was given).
        """
        owner = self._owner_of(True)
        if owner is None:
            raise self.not_found()
        return RemoteRef(self._send("remote", owner), owner, self.not_found)


def chain_future(
    raw: torch.futures.Future[Any], target: str, finish: Callable[[Any], Any], op: str = "rpc_async"
) -> torch.futures.Future[Any]:
    """A future completed with ``finish(envelope)``, or its exception, torch's failures mapped.

    ``op`` names the call in a lost peer's error (``"rpc_async"``, or ``"rpc"`` for a service's call).
    """
    out: torch.futures.Future[Any] = torch.futures.Future()

    def done(fut: torch.futures.Future[Any]) -> None:
        try:
            envelope = fut.wait()
        except (RuntimeError, OSError) as exc:
            out.set_exception(with_cause(peer_error(exc, target, op), exc))
            return
        except Exception as exc:  # anything else as it is: a callback that raised would leave ``out`` pending
            out.set_exception(exc)
            return
        try:
            out.set_result(finish(envelope))
        except Exception as exc:
            out.set_exception(exc)

    raw.add_done_callback(done)
    return out
