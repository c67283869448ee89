"""RpcGroup: named RPC members with a single-owner directory of paired values and registered services.

The directory lives in the world's store: ``rg/<group>/dir/<kind>/<repr(key)>`` holds the owner's name, set
with an atomic compare-and-set (the first writer wins). The value or service itself lives only in the owner's
locked local table (``_remote``). Callers cache ``key -> owner``, so a ``registered_sync`` on the hot path is
one RPC; an owner that lost the key answers "missing", and the caller looks up again and retries once.

Keys may be any value whose ``repr`` is the same in every process (strings, ints, tuples of those).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.rpc as rpc

from pc_distributed import _remote
from pc_distributed._remote import MissingOnOwner, unwrap
from pc_distributed._rpc_util import (
    SERVICE,
    VALUE,
    chain_future,
    check_call_args,
    check_timeout,
    claim_entry,
    join_group,
    release_entry,
    transport_error,
    with_cause,
)
from pc_distributed._store import lookup, release, store_barrier
from pc_distributed.remote_ref import RemoteRef
from pc_distributed.world import get_world

if TYPE_CHECKING:
    from pc_distributed.world import World

__all__ = ["RpcGroup", "create_rpc_group"]


class RpcGroup:
    """A group of named members that call each other, pair values and register services.

    Create it with :meth:`World.create_rpc_group` (members only). Pickling sends a ``(name, members)`` handle:
    in a process with the live group it resolves to it; elsewhere it can call services and read paired values
    but not pair, register or join barriers.

    Args:
        group_name: Name of the group.
        group_members: Member names.
        first_create: True for the live group of a member (made by ``create_rpc_group``), False for a handle.
    """

    def __init__(self, group_name: str, group_members: Sequence[str], first_create: bool = True) -> None:
        self.group_name = group_name
        self.group_members = sorted(group_members)
        self.destroyed = False
        self._live = bool(first_create)
        self._instance = 0
        self._barrier_gen = 0
        self._barrier_lock = threading.Lock()
        self._cache: dict[tuple[str, str], str] = {}
        self._tables = _remote.install_tables(group_name) if first_create else None

    # -- plumbing ---
    def _world(self) -> World:
        world = get_world()
        if world is None:
            raise RuntimeError(f"RpcGroup {self.group_name!r}: no World in this process")
        return world

    def _dir_key(self, kind: str, ktext: str) -> str:
        return f"rg/{self.group_name}/dir/{kind}/{ktext}"

    def _local(self, what: str) -> _remote.GroupTables:
        if self.destroyed:
            raise RuntimeError(f"RpcGroup {self.group_name!r} has been destroyed")
        if not self._live or self._tables is None:
            raise RuntimeError(
                f"{what} needs the live group: create RpcGroup {self.group_name!r} with "
                "World.create_rpc_group "
                "in this process (this is a handle)"
            )
        return self._tables

    def _owner(self, kind: str, ktext: str, refresh: bool) -> str | None:
        ck = (kind, ktext)
        if not refresh:
            owner = self._cache.get(ck)
            if owner is not None:
                return owner
        owner = lookup(self._world().store, self._dir_key(kind, ktext))
        if owner is None:
            self._cache.pop(ck, None)
        else:
            self._cache[ck] = owner
        return owner

    def _not_found(self, kind: str, key: Any) -> KeyError:
        label = "Service" if kind == SERVICE else "Value"
        return KeyError(f"{label} with key [{key}] not found on Group [{self.group_name}]")

    def _check_target(self, to: object) -> str:
        if not isinstance(to, str):
            raise TypeError(f"to must be a member name (str), got {type(to).__name__} {to!r}")
        if to not in self.group_members:
            raise ValueError(
                f"RPC target {to!r} is not a member of group {self.group_name!r}: {self.group_members}"
            )
        return to

    def _invoke(
        self, method: Callable[..., Any], to: str, func: Any, args: tuple[Any, ...], timeout: float
    ) -> Any:
        if self.destroyed:
            raise RuntimeError(f"RpcGroup {self.group_name!r} has been destroyed")
        if not self._world().init_rpc:
            raise RuntimeError("RPC calls need a World created with init_rpc=True")
        try:
            return method(to, func, args=args, timeout=timeout)
        except RuntimeError as exc:
            raise transport_error(exc, to, method.__name__) from exc

    # -- pairing ---
    def pair(self, key: Any, value: Any) -> None:
        """Pair ``value`` to ``key`` in this group; this process becomes its owner. First writer wins.

        Raises:
            KeyError: If ``key`` is already paired (by any member).
        """
        self._claim(VALUE, key, value, f'Value with key "{key}" already paired to Group [{self.group_name}]')

    def unpair(self, key: Any) -> None:
        """Unpair ``key``; only its owner may.

        Raises:
            KeyError: If this process did not pair ``key``.
        """
        msg = (
            f'Value with key "{key}" not paired to Group [{self.group_name}] '
            f"on Process[{self.get_cur_name()}]"
        )
        self._release(VALUE, key, msg)

    def is_paired(self, key: Any) -> bool:
        """Whether ``key`` is paired in this group (asks the directory)."""
        return self._owner(VALUE, repr(key), refresh=True) is not None

    def get_paired(self, key: Any) -> RemoteRef:
        """A reference to the value paired to ``key``; ``to_here()`` returns a copy.

        Raises:
            KeyError: If ``key`` is not paired.
        """
        ktext = repr(key)
        owner = self._owner(VALUE, ktext, refresh=True)
        if owner is None:
            raise self._not_found(VALUE, key)
        rref = self._invoke(rpc.remote, owner, _remote.paired_value, (self.group_name, ktext), -1)
        return RemoteRef(rref, owner, lambda: self._not_found(VALUE, key))

    # -- services ---
    def register(self, key: Any, service: Callable[..., Any]) -> None:
        """Register a callable under ``key``; calls run it on this process's live object. First writer wins.

        Raises:
            TypeError: If ``service`` is not callable.
            KeyError: If ``key`` is already registered (by any member).
        """
        if not callable(service):
            raise TypeError(f"service must be callable, got {type(service).__name__}")
        self._claim(
            SERVICE,
            key,
            service,
            f'Service with key "{key}" already registered in Group [{self.group_name}]',
        )

    def deregister(self, key: Any) -> None:
        """Deregister ``key``; only its owner may.

        Raises:
            KeyError: If this process did not register ``key``.
        """
        msg = (
            f'Service with key "{key}" not registered in Group [{self.group_name}] '
            f"on Process[{self.get_cur_name()}]"
        )
        self._release(SERVICE, key, msg)

    def is_registered(self, key: Any) -> bool:
        """Whether a service is registered under ``key`` (asks the directory)."""
        return self._owner(SERVICE, repr(key), refresh=True) is not None

    def registered_sync(
        self, key: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None, timeout: float = -1
    ) -> Any:
        """Call the service ``key`` on its owner and return its result (one RPC when the owner is cached).

        Args:
            key: Key of the registered service.
            args: Positional arguments.
            kwargs: Keyword arguments.
            timeout: Seconds (-1: the world's ``rpc_timeout``).

        Raises:
            KeyError: If no service is registered under ``key``.
            TimeoutError: If the owner did not answer in time.
            ConnectionError: If the owner is unreachable (e.g. dead).
            Exception: The service's exception, original type, remote traceback as ``__cause__``.
        """
        call_args, call_kwargs = check_call_args(args, kwargs)
        timeout = check_timeout(timeout)
        ktext = repr(key)
        for refresh in (False, True):
            owner = self._owner(SERVICE, ktext, refresh)
            if owner is None:
                break
            envelope = self._invoke(
                rpc.rpc_sync,
                owner,
                _remote.call_service,
                (self.group_name, ktext, call_args, call_kwargs),
                timeout,
            )
            try:
                return unwrap(envelope, f"process {owner!r}")
            except MissingOnOwner:
                continue
        raise self._not_found(SERVICE, key)

    def registered_async(
        self, key: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None, timeout: float = -1
    ) -> torch.futures.Future[Any]:
        """Call the service ``key`` asynchronously; ``wait()`` on the future returns its result or raises.

        Errors are those of :meth:`registered_sync`, raised by ``wait()``.
        """
        call_args, call_kwargs = check_call_args(args, kwargs)
        timeout = check_timeout(timeout)
        ktext = repr(key)
        out: torch.futures.Future[Any] = torch.futures.Future()

        def attempt(refresh: bool) -> None:
            owner = self._owner(SERVICE, ktext, refresh)
            if owner is None:
                out.set_exception(self._not_found(SERVICE, key))
                return
            raw = self._invoke(
                rpc.rpc_async,
                owner,
                _remote.call_service,
                (self.group_name, ktext, call_args, call_kwargs),
                timeout,
            )

            def done(fut: torch.futures.Future[Any]) -> None:
                try:
                    envelope = fut.wait()
                except RuntimeError as exc:
                    out.set_exception(with_cause(transport_error(exc, owner, "rpc_async"), exc))
                    return
                try:
                    out.set_result(unwrap(envelope, f"process {owner!r}"))
                except MissingOnOwner:
                    if refresh:
                        out.set_exception(self._not_found(SERVICE, key))
                    else:
                        try:
                            attempt(True)
                        except Exception as exc:
                            out.set_exception(exc)
                except Exception as exc:
                    out.set_exception(exc)

            raw.add_done_callback(done)

        attempt(False)
        return out

    def registered_remote(
        self, key: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None, timeout: float = -1
    ) -> RemoteRef:
        """Run the service ``key`` on its owner; return a :class:`RemoteRef` to the result.

        Raises:
            KeyError: If no service is registered under ``key`` (raised here, or by ``to_here()`` when the
                owner dropped it meanwhile).
        """
        call_args, call_kwargs = check_call_args(args, kwargs)
        timeout = check_timeout(timeout)
        ktext = repr(key)
        owner = self._owner(SERVICE, ktext, refresh=True)
        if owner is None:
            raise self._not_found(SERVICE, key)
        rref = self._invoke(
            rpc.remote, owner, _remote.call_service, (self.group_name, ktext, call_args, call_kwargs), timeout
        )
        return RemoteRef(rref, owner, lambda: self._not_found(SERVICE, key))

    # -- plain calls ---
    def rpc_sync(
        self,
        to: str,
        func: Callable[..., Any],
        timeout: float = -1,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Run ``func(*args, **kwargs)`` on member ``to`` and return the result.

        ``func`` must be picklable by reference (a module-level function or a builtin).

        Raises:
            ValueError: If ``to`` is not a member.
            TimeoutError: If ``to`` did not answer within ``timeout`` (-1: the world's ``rpc_timeout``).
            ConnectionError: If ``to`` is unreachable.
            Exception: ``func``'s exception, original type, remote traceback as ``__cause__``.
        """
        to = self._check_target(to)
        call_args, call_kwargs = check_call_args(args, kwargs)
        envelope = self._invoke(
            rpc.rpc_sync, to, _remote.call_func, (func, call_args, call_kwargs), check_timeout(timeout)
        )
        return unwrap(envelope, f"process {to!r}")

    def rpc_async(
        self,
        to: str,
        func: Callable[..., Any],
        timeout: float = -1,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> torch.futures.Future[Any]:
        """Run ``func`` on member ``to`` asynchronously; ``wait()`` returns the result or raises."""
        to = self._check_target(to)
        call_args, call_kwargs = check_call_args(args, kwargs)
        raw = self._invoke(
            rpc.rpc_async, to, _remote.call_func, (func, call_args, call_kwargs), check_timeout(timeout)
        )
        return chain_future(raw, to, lambda envelope: unwrap(envelope, f"process {to!r}"))

    def remote(
        self,
        to: str,
        func: Callable[..., Any],
        timeout: float = -1,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> RemoteRef:
        """Run ``func`` on member ``to``; return a :class:`RemoteRef` to the result (owned by ``to``)."""
        to = self._check_target(to)
        call_args, call_kwargs = check_call_args(args, kwargs)
        rref = self._invoke(
            rpc.remote, to, _remote.call_func, (func, call_args, call_kwargs), check_timeout(timeout)
        )
        return RemoteRef(rref, to, lambda: KeyError(f"result not found on {to!r}"))

    # -- membership ---
    def barrier(self, timeout: float | None = None) -> None:
        """Block until every member entered this barrier (repeatable, no lost wake-ups; one thread at a time).

        The wait runs on a store connection of its own, so the process's other threads keep calling,
        looking up and registering meanwhile.

        Args:
            timeout: Seconds (default: the world's ``rpc_timeout``).

        Raises:
            TimeoutError: Naming the members that did not arrive.
        """
        self._local("barrier")
        world = self._world()
        limit = world.rpc_timeout if timeout is None else check_timeout(timeout)
        with self._barrier_lock:
            gen = self._barrier_gen
            self._barrier_gen += 1
        prefix = f"rg/{self.group_name}/{self._instance}/bar"
        store_barrier(world.store, world.waits, prefix, gen, world.name, self.group_members, limit)

    def destroy(self) -> None:
        """Leave the group: remove this process's directory entries and local tables (idempotent)."""
        if self.destroyed:
            return
        self.destroyed = True
        if not self._live:
            return
        tables = _remote.drop_tables(self.group_name)
        world = get_world()
        if world is not None:
            world.groups.pop(self.group_name, None)
            if tables is not None:
                with tables.lock:
                    entries = [(VALUE, k) for k in tables.values] + [(SERVICE, k) for k in tables.services]
                for kind, ktext in entries:
                    release(world.store, self._dir_key(kind, ktext), world.name)

    def size(self) -> int:
        """Number of members."""
        return len(self.group_members)

    def is_member(self, target: str | None = None) -> bool:
        """Whether ``target`` (default: this process) is a member."""
        return (self.get_cur_name() if target is None else target) in self.group_members

    def get_group_name(self) -> str:
        """Name of this group."""
        return self.group_name

    def get_group_members(self) -> list[str]:
        """Member names, sorted."""
        return list(self.group_members)

    def get_cur_name(self) -> str:
        """This process's member name."""
        return self._world().name

    # -- directory helpers ---
    def _claim(self, kind: str, key: Any, obj: Any, taken: str) -> None:
        tables, world = self._local("pair" if kind == VALUE else "register"), self._world()
        ktext = repr(key)
        claim_entry(tables, kind, ktext, obj, world.store, self._dir_key(kind, ktext), world.name, taken)
        self._cache[(kind, ktext)] = world.name

    def _release(self, kind: str, key: Any, not_owner: str) -> None:
        tables, world = self._local("unpair" if kind == VALUE else "deregister"), self._world()
        ktext = repr(key)
        release_entry(tables, kind, ktext, world.store, self._dir_key(kind, ktext), world.name, not_owner)
        self._cache.pop((kind, ktext), None)

    def __reduce__(self) -> tuple[Callable[..., RpcGroup], tuple[str, list[str]]]:
        return _rebuild_rpc_group, (self.group_name, list(self.group_members))

    def __repr__(self) -> str:
        return f"RpcGroup({self.group_name!r}, {self.group_members})"


def _rebuild_rpc_group(group_name: str, members: list[str]) -> RpcGroup:
    world = get_world()
    if world is not None:
        live = world.groups.get(group_name)
        if live is not None and not live.destroyed:
            return live
    return RpcGroup(group_name, members, first_create=False)


def create_rpc_group(world: World, group_name: str, members: Sequence[str], timeout: float) -> RpcGroup:
    """Join RPC group ``group_name``: check the members agree through the store, then build the live group."""
    names, instance = join_group(world, group_name, members, timeout)
    group = RpcGroup(group_name, names, first_create=True)
    group._instance = instance
    world.groups[group_name] = group
    return group
