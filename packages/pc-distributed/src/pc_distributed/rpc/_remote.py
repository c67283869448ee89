"""What runs on the far side of an RPC: per-process tables of paired values and services, and envelopes.

RPC targets never raise. They return an envelope: ``(OK, value)``, ``(ERR, exception, traceback_text)`` or
``(MISSING,)`` when this process does not own the key (a stale cache entry on the caller). The caller's side
(:func:`unwrap`) raises the original exception type with the remote traceback as ``__cause__``; torch's own
RPC error path would turn every exception into a string.

    caller                         owner
    ------                         -----
    rpc_sync(owner, call_service) ──> call_service(group, key, args, kwargs)
                                        tables[group].services[key](*args, **kwargs)
    unwrap(envelope) <─────────────── (OK, result) | (ERR, exc, tb) | (MISSING,)
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pc_distributed._errors import format_exception, portable_exception, reraise_remote

__all__ = [
    "ERR",
    "MISSING",
    "OK",
    "SERVICE",
    "SETTLE_TIMEOUT",
    "VALUE",
    "GroupTables",
    "MissingOnOwner",
    "call_func",
    "call_service",
    "drop_tables",
    "get_tables",
    "install_tables",
    "paired_value",
    "unwrap",
]

OK = 0
ERR = 1
MISSING = 2

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


_TABLES: dict[str, GroupTables] = {}
_TABLES_LOCK = threading.Lock()


def install_tables(group: str) -> GroupTables:
    """Create (or return) this process's tables for ``group``."""
    with _TABLES_LOCK:
        return _TABLES.setdefault(group, GroupTables())


def get_tables(group: str) -> GroupTables | None:
    """This process's tables for ``group``, or None."""
    with _TABLES_LOCK:
        return _TABLES.get(group)


def drop_tables(group: str) -> GroupTables | None:
    """Remove and return this process's tables for ``group``."""
    with _TABLES_LOCK:
        return _TABLES.pop(group, None)


def _run(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Envelope:
    try:
        return (OK, fn(*args, **kwargs))
    except Exception as exc:
        return (ERR, portable_exception(exc), format_exception(exc))


def call_service(group: str, key: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Envelope:
    """RPC target: run the service registered under ``key`` on this process's live object."""
    tables = get_tables(group)
    if tables is None:
        return (MISSING,)
    with tables.lock:
        tables.wait_settled(SERVICE, key)  # only a call racing with this very key's (de)registration waits
        service = None if (SERVICE, key) in tables.pending else tables.services.get(key)
    if service is None:
        return (MISSING,)
    return _run(service, args, kwargs)


def paired_value(group: str, key: str) -> Envelope:
    """RPC target: the value paired under ``key`` on this process."""
    tables = get_tables(group)
    if tables is None:
        return (MISSING,)
    with tables.lock:
        tables.wait_settled(VALUE, key)
        if key not in tables.values or (VALUE, key) in tables.pending:
            return (MISSING,)
        return (OK, tables.values[key])


def call_func(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Envelope:
    """RPC target: run ``func(*args, **kwargs)`` and return the envelope."""
    return _run(func, args, kwargs)


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
    if status == ERR:
        raise reraise_remote(envelope[1], envelope[2], where)
    raise MissingOnOwner(where)
