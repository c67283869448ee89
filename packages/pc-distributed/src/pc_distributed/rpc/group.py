"""RpcGroup: named RPC members with a single-owner directory of paired values and registered services.

A live group holds the World it was created by (given at creation) and, through it, the store of its
directory (``_directory``). The value or service itself lives only in the owner's locked local table
(``_remote``), which the owner's World holds. A call to a service (a ``ServiceCall`` of ``_calls``) is one
RPC when the owner is cached or given, and none when the owner is this process; an owner that lost the key
answers "missing", and the caller looks up again and retries once (``registered_sync`` waits in the
caller's thread, as a raw ``rpc_sync`` does).

The World creates its groups here (``create_rpc_group``) and holds their tables (``ProcessTables``, from
``_remote``).

Keys may be any value whose ``repr`` is the same in every process (strings, ints, tuples of those).
Timeouts follow the package's convention (``_checks``): ``None`` (or ``-1``) is the World's
``rpc_timeout``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from pc_distributed._checks import check_call_args, resolve_timeout
from pc_distributed._host import GroupHost, current_world
from pc_distributed._one_thread import OneThreadAtATime
from pc_distributed._store import StoreBarrier
from pc_distributed.rpc._calls import Send, ServiceCall, chain_future, invoke
from pc_distributed.rpc._directory import Directory
from pc_distributed.rpc._join import check_group_args, join_group
from pc_distributed.rpc._remote import (
    SERVICE,
    VALUE,
    GroupTables,
    ProcessTables,
    call_func,
    paired_value,
    unwrap,
)
from pc_distributed.rpc.remote_ref import RemoteRef

__all__ = ["ProcessTables", "RpcGroup", "create_rpc_group"]

# What the elements of each payload are, to name an unpicklable one: a call (func, args, kwargs), a
# paired-value look-up (group, key); a service call names its own (``_calls``).
_PAYLOAD_PARTS = {3: ("func", "args", "kwargs"), 2: ("group", "key")}


class RpcGroup:
    """A group of named members that call each other, pair values and register services.

    Create it with :meth:`World.create_rpc_group` (members only). Pickling sends a ``(name, members)`` handle:
    in a process with the live group it resolves to it; elsewhere it can call services and read paired values
    but not pair, register or join barriers.

    Args:
        group_name: Name of the group.
        group_members: Member names.
        first_create: True for the live group of a member (made by ``create_rpc_group``), False for a handle.
        world: The World the group belongs to (default: this process's World, looked up when first needed).
        instance: How many groups of this name this process created before (scopes the barrier's keys).
    """

    def __init__(
        self,
        group_name: str,
        group_members: Sequence[str],
        first_create: bool = True,
        *,
        world: GroupHost | None = None,
        instance: int = 0,
    ) -> None:
        self.group_name = group_name
        self.group_members = sorted(group_members)
        self.destroyed = False
        self._live = bool(first_create)
        self._host = world
        self._instance = instance
        self._barrier_gen = 0
        self._barrier_one_thread = OneThreadAtATime(f"RPC group {group_name!r}")
        self._directory: Directory | None = None
        self._tables: GroupTables | None = None
        if first_create:
            self._tables = self._world().rpc_tables.install(group_name)

    # -- plumbing ---
    def _world(self) -> GroupHost:
        if self._host is None:  # a group made by hand, or unpickled before this process had a World
            self._host = current_world()
            if self._host is None:
                raise RuntimeError(f"RpcGroup {self.group_name!r}: no World in this process")
        return self._host

    def _dir(self) -> Directory:
        if self._directory is None:
            self._directory = Directory(self._world(), self.group_name)
        return self._directory

    def _seconds(self, timeout: float | None) -> float:
        return resolve_timeout(timeout, self._world().rpc_timeout)

    def _local(self, what: str) -> GroupTables:
        if self.destroyed:
            raise RuntimeError(f"RpcGroup {self.group_name!r} has been destroyed")
        if not self._live or self._tables is None:
            raise RuntimeError(
                f"{what} needs the live group: create RpcGroup {self.group_name!r} with "
                "World.create_rpc_group in this process (this is a handle)"
            )
        return self._tables

    def _value_not_found(self, key: Any) -> KeyError:
        return KeyError(f"Value with key [{key}] not found on Group [{self.group_name}]")

    def _check_target(self, to: object, label: str = "to") -> str:
        if not isinstance(to, str):
            raise TypeError(f"{label} must be a member name (str), got {type(to).__name__} {to!r}")
        if to not in self.group_members:
            raise ValueError(
                f"RPC target {to!r} is not a member of group {self.group_name!r}: {self.group_members}"
            )
        return to

    def _invoke(self, send: Send, to: str, func: Any, args: tuple[Any, ...], timeout: float) -> Any:
        if self.destroyed:
            raise RuntimeError(f"RpcGroup {self.group_name!r} has been destroyed")
        return invoke(self._world(), send, to, func, args, timeout, _PAYLOAD_PARTS.get(len(args), ()))

    def _service_call(
        self,
        key: Any,
        args: Sequence[Any],
        kwargs: dict[str, Any] | None,
        timeout: float | None,
        owner: str | None,
    ) -> ServiceCall:
        if self.destroyed:
            raise RuntimeError(f"RpcGroup {self.group_name!r} has been destroyed")
        call_args, call_kwargs = check_call_args(args, kwargs)
        seconds = self._seconds(timeout)
        if owner is not None:
            owner = self._check_target(owner, "owner")
        return ServiceCall(
            self._world(), self._dir(), self.group_name, key, call_args, call_kwargs, seconds, owner
        )

    # -- pairing ---
    def pair(self, key: Any, value: Any) -> None:
        """Pair ``value`` to ``key`` in this group; this process becomes its owner. First writer wins.

        Raises:
            KeyError: If ``key`` is already paired (by any member).
        """
        tables = self._local("pair")
        taken = f'Value with key "{key}" already paired to Group [{self.group_name}]'
        self._dir().claim(tables, VALUE, repr(key), value, taken)

    def unpair(self, key: Any) -> None:
        """Unpair ``key``; only its owner may.

        Raises:
            KeyError: If this process did not pair ``key``.
        """
        tables = self._local("unpair")
        msg = (
            f'Value with key "{key}" not paired to Group [{self.group_name}] '
            f"on Process[{self.get_cur_name()}]"
        )
        self._dir().release(tables, VALUE, repr(key), msg)

    def is_paired(self, key: Any) -> bool:
        """Whether ``key`` is paired in this group (asks the directory)."""
        return self._dir().owner(VALUE, repr(key), refresh=True) is not None

    def get_paired(self, key: Any) -> RemoteRef:
        """A reference to the value paired to ``key``; ``to_here()`` returns a copy.

        Raises:
            KeyError: If ``key`` is not paired.
        """
        ktext = repr(key)
        owner = self._dir().owner(VALUE, ktext, refresh=True)
        if owner is None:
            raise self._value_not_found(key)
        payload = (self.group_name, ktext)
        rref = self._invoke("remote", owner, paired_value, payload, self._seconds(None))
        return RemoteRef(rref, owner, lambda: self._value_not_found(key))

    # -- services ---
    def register(self, key: Any, service: Callable[..., Any]) -> None:
        """Register a callable under ``key``; calls run it on this process's live object. First writer wins.

        Raises:
            TypeError: If ``service`` is not callable.
            KeyError: If ``key`` is already registered (by any member).
        """
        if not callable(service):
            raise TypeError(f"service must be callable, got {type(service).__name__}")
        tables = self._local("register")
        taken = f'Service with key "{key}" already registered in Group [{self.group_name}]'
        self._dir().claim(tables, SERVICE, repr(key), service, taken)

    def deregister(self, key: Any) -> None:
        """Deregister ``key``; only its owner may.

        Raises:
            KeyError: If this process did not register ``key``.
        """
        tables = self._local("deregister")
        msg = (
            f'Service with key "{key}" not registered in Group [{self.group_name}] '
            f"on Process[{self.get_cur_name()}]"
        )
        self._dir().release(tables, SERVICE, repr(key), msg)

    def is_registered(self, key: Any) -> bool:
        """Whether a service is registered under ``key`` (asks the directory)."""
        return self._dir().owner(SERVICE, repr(key), refresh=True) is not None

    def registered_sync(
        self,
        key: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        *,
        owner: str | None = None,
    ) -> Any:
        """Call the service ``key`` on its owner and return its result (one RPC when the owner is known).

        When the owner is this process the service runs here, in the caller's thread, without an RPC to
        itself; the arguments and the result are still copied as an RPC would copy them (a pickle round
        trip, tensors cloned once), so the caller never shares an object with the service, and what cannot
        be pickled raises the same ``TypeError``. That call is not bounded by ``timeout``: the caller's
        thread runs the service itself.

        Args:
            key: Key of the registered service.
            args: Positional arguments.
            kwargs: Keyword arguments.
            timeout: Seconds of each attempt (None or -1: the World's ``rpc_timeout``).
            owner: The member that registered ``key``, when the caller knows it: the call goes there
                directly, without asking the group's directory (no store request), and is not retried
                elsewhere.

        Raises:
            KeyError: If no service is registered under ``key`` (or ``owner`` does not hold it).
            ValueError: If ``owner`` is not a member.
            TypeError: If an argument can be pickled neither by pickle nor by value with pc-pickle, or the
                result cannot be pickled (the message names it).
            TimeoutError: If the owner did not answer in time.
            ConnectionError: If the owner is unreachable (e.g. dead).
            Exception: The service's exception, original type, remote traceback as ``__cause__``.
        """
        return self._service_call(key, args, kwargs, timeout, owner).sync()

    def registered_async(
        self,
        key: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        *,
        owner: str | None = None,
    ) -> torch.futures.Future[Any]:
        """Call the service ``key`` asynchronously; ``wait()`` on the future returns its result or raises.

        Always one RPC, also when this process is the owner (the service runs on an RPC thread while the
        caller goes on). Errors are those of :meth:`registered_sync`, raised by ``wait()``; the future
        completes within the timeout of each attempt (a dead owner ends it with ``ConnectionError`` or
        ``TimeoutError``). ``owner``: as in :meth:`registered_sync`.
        """
        return self._service_call(key, args, kwargs, timeout, owner).future()

    def registered_remote(
        self,
        key: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        *,
        owner: str | None = None,
    ) -> RemoteRef:
        """Run the service ``key`` on its owner; return a :class:`RemoteRef` to the result.

        ``owner``: as in :meth:`registered_sync`.

        Raises:
            KeyError: If no service is registered under ``key`` (raised here, or by ``to_here()`` when the
                owner dropped it meanwhile).
        """
        return self._service_call(key, args, kwargs, timeout, owner).remote()

    # -- plain calls ---
    def rpc_sync(
        self,
        to: str,
        func: Callable[..., Any],
        timeout: float | None = None,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Run ``func(*args, **kwargs)`` on member ``to`` and return the result.

        ``func`` and the arguments go by pickle; what it refuses (a lambda, a closure) goes by value with
        pc-pickle. The result goes back by pickle.

        Raises:
            ValueError: If ``to`` is not a member.
            TypeError: If ``func`` or an argument can be pickled neither way (the message names it; pickle's
                error is the ``__cause__``).
            TimeoutError: If ``to`` did not answer within ``timeout`` (None or -1: the World's
                ``rpc_timeout``).
            ConnectionError: If ``to`` is unreachable.
            Exception: ``func``'s exception, original type, remote traceback as ``__cause__``.
        """
        to = self._check_target(to)
        call_args, call_kwargs = check_call_args(args, kwargs)
        payload = (func, call_args, call_kwargs)
        envelope = self._invoke("rpc_sync", to, call_func, payload, self._seconds(timeout))
        return unwrap(envelope, f"process {to!r}")

    def rpc_async(
        self,
        to: str,
        func: Callable[..., Any],
        timeout: float | None = None,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> torch.futures.Future[Any]:
        """Run ``func`` on member ``to`` asynchronously; ``wait()`` returns the result or raises."""
        to = self._check_target(to)
        call_args, call_kwargs = check_call_args(args, kwargs)
        payload = (func, call_args, call_kwargs)
        raw = self._invoke("rpc_async", to, call_func, payload, self._seconds(timeout))
        return chain_future(raw, to, lambda envelope: unwrap(envelope, f"process {to!r}"))

    def remote(
        self,
        to: str,
        func: Callable[..., Any],
        timeout: float | None = None,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> RemoteRef:
        """Run ``func`` on member ``to``; return a :class:`RemoteRef` to the result (owned by ``to``)."""
        to = self._check_target(to)
        call_args, call_kwargs = check_call_args(args, kwargs)
        payload = (func, call_args, call_kwargs)
        rref = self._invoke("remote", to, call_func, payload, self._seconds(timeout))
        return RemoteRef(rref, to, lambda: KeyError(f"result not found on {to!r}"))

    # -- membership ---
    def barrier(self, timeout: float | None = None) -> None:
        """Block until every member entered this barrier (repeatable, no lost wake-ups).

        The wait runs on a store connection of its own, so the process's other threads keep calling,
        looking up and registering meanwhile.

        Args:
            timeout: Seconds (None or -1: the World's ``rpc_timeout``).

        Raises:
            TimeoutError: Naming the members that did not arrive.
            RuntimeError: Another thread of this process is inside this group's ``barrier`` (one thread at
                a time: each call is this member's next barrier of the group).
        """
        self._local("barrier")
        world = self._world()
        limit = self._seconds(timeout)
        with self._barrier_one_thread("barrier"):  # generations must match the peers' barriers one by one
            gen = self._barrier_gen
            self._barrier_gen += 1
            prefix = f"rg/{self.group_name}/{self._instance}/bar"
            StoreBarrier(world.store, world.waits, prefix, world.name, self.group_members).enter(gen, limit)

    def destroy(self) -> None:
        """Leave the group: remove this process's directory entries and local tables (idempotent)."""
        if self.destroyed:
            return
        self.destroyed = True
        if not self._live:
            return
        if self._host is None and current_world() is None:
            return
        world = self._world()
        tables = world.rpc_tables.drop(self.group_name)
        world.detach_rpc_group(self.group_name, self)
        if tables is not None:
            self._dir().release_all(tables)

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

    def __reduce__(self) -> tuple[Callable[..., RpcGroup], tuple[str, list[str]]]:
        return _rebuild_rpc_group, (self.group_name, list(self.group_members))

    def __repr__(self) -> str:
        return f"RpcGroup({self.group_name!r}, {self.group_members})"


def _rebuild_rpc_group(group_name: str, members: list[str]) -> RpcGroup:
    """Unpickle a group: the live group of this process if it has one, else a handle on its World."""
    world = current_world()
    if world is not None:
        live = world.get_rpc_group(group_name)
        if live is not None and not live.destroyed:
            return live  # type: ignore[no-any-return]
    return RpcGroup(group_name, members, first_create=False, world=world)


def create_rpc_group(world: GroupHost, group_name: str, members: Sequence[str], timeout: float) -> RpcGroup:
    """Join RPC group ``group_name``: check the members agree through the store, then build the live group."""
    names = check_group_args(world, group_name, members)
    instance = join_group(world, group_name, names, timeout)
    group = RpcGroup(group_name, names, first_create=True, world=world, instance=instance)
    world.attach_rpc_group(group_name, group)
    return group
