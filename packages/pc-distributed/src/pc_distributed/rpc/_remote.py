"""What runs on the owner's side of a call: the tables of paired values and services, and envelopes.

The tables of every live RPC group of a process belong to its World (:class:`ProcessTables`); an incoming
RPC finds them through the process's current World. A call of a service this process owns runs the same
:func:`run_service` without an RPC, on :func:`copy_as_sent` copies.

RPC targets never raise. They return an envelope: ``(OK, value)``, ``(BY_VALUE, pc-pickle bytes of the
value)``, ``(ERR, exception, traceback_text)`` or ``(MISSING,)`` when this process does not own the key (a
stale cache entry on the caller). The caller's side (:func:`unwrap`) returns the value, or raises the original
exception type with the remote traceback as ``__cause__``; torch's own RPC error path would turn every
exception into a string.

What plain pickle refuses (a lambda, a closure, a class defined in a function) travels by value with
pc-pickle, both ways. A call: the caller sends :func:`call_by_value` with pc-pickle's bytes of the target and
its arguments. A result: on a backend whose own pickler is plain pickle (TensorPipe: its
``plain_pickles``), a target returns ``BY_VALUE`` when plain pickle would refuse the value and pc-pickle
takes it; the c10d backend's pickler carries such values itself. :func:`copy_by_either` makes the same copies
for a call run in this process.

    caller                         owner
    ------                         -----
    rpc_sync(owner, call_service) ──> call_service(group, key, args, kwargs)
                                        tables[group].services[key](*args, **kwargs)
    unwrap(envelope) <─────────────── (OK, result) | (ERR, exc, tb) | (MISSING,)
"""

from __future__ import annotations

import copy
import io
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import pc_pickle
from pc_distributed._errors import format_exception, portable_exception, reraise_remote
from pc_distributed._host import current_world

__all__ = [
    "BY_VALUE",
    "ERR",
    "MISSING",
    "OK",
    "SERVICE",
    "SETTLE_TIMEOUT",
    "VALUE",
    "GroupTables",
    "MissingOnOwner",
    "ProcessTables",
    "call_by_value",
    "call_func",
    "call_service",
    "copy_as_sent",
    "copy_by_either",
    "paired_value",
    "run_service",
    "unwrap",
]

OK = 0
ERR = 1
MISSING = 2
BY_VALUE = 3

VALUE = "value"
SERVICE = "service"
# Longest time an RPC target waits for a claim or release of its own key that is in flight (one store request;
# normally well under a millisecond). After it, the key counts as missing.
SETTLE_TIMEOUT = 60.0

Envelope = tuple[Any, ...]


class MissingOnOwner(LookupError):  # noqa: N818 - an internal signal, never raised to users
    """The process the cache pointed at does not own the key (any more)."""


@dataclass
class GroupTables:
    """This process's paired values and services of one RPC group, behind a lock.

    The lock is never held across a store request: a key whose directory claim or release is in flight is in
    ``pending`` (as ``(kind, key)``), and ``settled`` (a condition on ``lock``) is notified when it leaves.
    """

    values: dict[str, Any] = field(default_factory=dict)
    services: dict[str, Callable[..., Any]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: set[tuple[str, str]] = field(default_factory=set)
    settled: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.settled = threading.Condition(self.lock)

    def wait_settled(self, kind: str, key: str) -> None:
        """With ``lock`` held: wait (at most ``SETTLE_TIMEOUT``) while ``key`` is claimed or released."""
        if (kind, key) in self.pending:
            self.settled.wait_for(lambda: (kind, key) not in self.pending, timeout=SETTLE_TIMEOUT)


class ProcessTables:
    """The tables of every live RPC group of this process, by group name: what a World owns for its groups.

    The RPC targets below reach them through the process's current World (the one process-wide pointer,
    ``_host.current_world``): torch runs an incoming call as a module-level function, with nothing but its
    arguments.
    """

    def __init__(self) -> None:
        self._tables: dict[str, GroupTables] = {}
        self._lock = threading.Lock()

    def install(self, group: str) -> GroupTables:
        """Create (or return) the tables of ``group``."""
        with self._lock:
            return self._tables.setdefault(group, GroupTables())

    def get(self, group: str) -> GroupTables | None:
        """The tables of ``group``, or None."""
        with self._lock:
            return self._tables.get(group)

    def drop(self, group: str) -> GroupTables | None:
        """Remove and return the tables of ``group``."""
        with self._lock:
            return self._tables.pop(group, None)


def _tables_of(group: str) -> GroupTables | None:
    world = current_world()
    tables: GroupTables | None = None if world is None else world.rpc_tables.get(group)
    return tables


def _run(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Envelope:
    try:
        value = fn(*args, **kwargs)
    except Exception as exc:
        return (ERR, portable_exception(exc), format_exception(exc))
    return _ok(value)


def _ok(value: Any) -> Envelope:
    """The envelope of a value: by value with pc-pickle where the World's backend would refuse it as it is.

    A value that neither the backend's pickler nor pc-pickle takes is a ``TypeError`` naming its type, sent
    back as the call's error.
    """
    world = current_world()
    backend = None if world is None else world.rpc_agent
    if backend is None or backend.plain_pickles(value):
        return (OK, value)
    try:
        return (BY_VALUE, pc_pickle.dumps(value))
    except Exception as exc:
        kind = type(value)
        error = TypeError(
            f"the result ({kind.__module__}.{kind.__qualname__}) can be pickled neither by pickle nor by "
            f"value with pc-pickle: {exc}"
        )
        return (ERR, error, format_exception(error))


def call_service(group: str, key: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Envelope:
    """RPC target: run the service registered under ``key`` in ``group`` on this process's live object."""
    return run_service(_tables_of(group), key, args, kwargs)


def run_service(
    tables: GroupTables | None, key: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Envelope:
    """Run the service registered under ``key`` in ``tables`` (None: a group this process does not hold)."""
    if tables is None:
        return (MISSING,)
    with tables.lock:
        tables.wait_settled(SERVICE, key)  # only a call racing with this very key's (de)registration waits
        service = None if (SERVICE, key) in tables.pending else tables.services.get(key)
    if service is None:
        return (MISSING,)
    return _run(service, args, kwargs)


def paired_value(group: str, key: str) -> Envelope:
    """RPC target: the value paired under ``key`` in ``group`` on this process."""
    tables = _tables_of(group)
    if tables is None:
        return (MISSING,)
    with tables.lock:
        tables.wait_settled(VALUE, key)
        if key not in tables.values or (VALUE, key) in tables.pending:
            return (MISSING,)
        value = tables.values[key]
    return _ok(value)


def call_func(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Envelope:
    """RPC target: run ``func(*args, **kwargs)`` and return the envelope."""
    return _run(func, args, kwargs)


def call_by_value(blob: bytes) -> Envelope:
    """RPC target: run a call that travelled by value; ``blob`` is pc-pickle's ``(target, args)``.

    ``target`` is one of this module's RPC targets (:func:`call_func`, :func:`call_service`, ...), so the
    envelope is theirs. A payload that does not load here (a function whose module this process cannot import)
    is an ``ERR`` envelope with that error, like an exception of the call.
    """
    try:
        target, args = pc_pickle.loads(blob)
    except Exception as exc:
        return (ERR, portable_exception(exc), format_exception(exc))
    envelope: Envelope = target(*args)
    return envelope


def unwrap(envelope: Envelope, where: str, copy_value: bool = False) -> Any:
    """Return the value of an envelope or raise its exception.

    Args:
        envelope: What an RPC target returned.
        where: Names the remote process for error notes.
        copy_value: Deep-copy the value (used when the envelope did not cross a process boundary).

    Raises:
        MissingOnOwner: If the owner no longer holds the key.
        Exception: The remote exception, with its original type and the remote traceback as ``__cause__``.
    """
    status = envelope[0]
    if status == OK:
        return copy.deepcopy(envelope[1]) if copy_value else envelope[1]
    if status == BY_VALUE:
        return pc_pickle.loads(envelope[1])
    if status == ERR:
        raise reraise_remote(envelope[1], envelope[2], where)
    raise MissingOnOwner(where)


class _CopyPickler(pickle.Pickler):
    """Pickles like RPC does, but hands plain tensors aside as clones (one copy, no bytes in between)."""

    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._tensors = tensors

    def persistent_id(self, obj: Any) -> int | None:
        if type(obj) is not torch.Tensor:
            return None
        clone = obj.detach().clone()
        if obj.requires_grad:
            clone.requires_grad_(True)
        self._tensors.append(clone)
        return len(self._tensors) - 1


class _CopyUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> torch.Tensor:
        return self._tensors[int(pid)]


def copy_as_sent(value: Any) -> Any:
    """The copy of ``value`` that an RPC to another process would deliver, made without leaving this one.

    A pickle round trip (so what RPC cannot send raises the same pickling error here) in which each tensor is
    cloned once instead of being serialised to bytes and back; a tensor that requires grad arrives as a leaf
    that requires grad, as over RPC outside a distributed autograd context.

    Raises:
        TypeError: (or pickle's own error) If ``value`` holds something that cannot be pickled.
    """
    tensors: list[torch.Tensor] = []
    buffer = io.BytesIO()
    _CopyPickler(buffer, tensors).dump(value)
    buffer.seek(0)
    return _CopyUnpickler(buffer, tensors).load()


def copy_by_either(obj: Any) -> Any:
    """:func:`copy_as_sent` of a call's arguments or result, by value with pc-pickle where pickle refuses.

    That is the copy a call to another process delivers (see the module).

    Raises:
        TypeError: (or pickle's own error) If neither plain pickle nor pc-pickle can carry ``obj``; the error
            raised is plain pickle's.
    """
    try:
        return copy_as_sent(obj)
    except (AttributeError, TypeError, pickle.PicklingError) as refused:
        try:
            return pc_pickle.loads(pc_pickle.dumps(obj))
        except Exception:
            raise refused from None
