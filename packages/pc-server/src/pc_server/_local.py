"""In-process short cuts: an accessor whose server lives in its own process calls it without an RPC to itself.

An RPC from a process to itself still goes the whole way through TensorPipe: the arguments are pickled, sent
over a loopback connection, unpickled on an RPC thread, and the reply comes back the same way. In the gradient
server every client on the primary's process pays that twice per push (its pull from the ordered server, and
every push its rotation sends to its own secondary), on the one process that also serves every other client's
pull and applies every step: with N clients on 2 cores it was the busiest process of all (docs/server.md,
"Performance").

A server registers itself here under its live group object and a name; an accessor asks for that name with
*its* group object. Only an accessor that resolved to the very live group the server was created with (an
unpickled accessor in the server's process does: a group handle unpickles to the process's live group) finds
it; a handle of another process, a destroyed group or a dead server finds nothing and goes through the RPC as
before. Entries are weak: they vanish with the server. What crosses a short cut is copied as a serialisation
would copy it (each caller says how), so a client never holds the server's stored objects.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from typing import Any

__all__ = ["find_local", "register_local"]

_Entry = tuple["weakref.ref[Any]", "weakref.ref[Any]"]
_ENTRIES: dict[tuple[int, str], _Entry] = {}
_LOCK = threading.Lock()


def register_local(group: object, name: str, target: Any) -> None:
    """Make ``target`` (a server object, or a bound method) reachable in this process under ``(group, name)``.

    Args:
        group: The live group the server was created with (held weakly).
        name: The server's or service's name within the group.
        target: What :func:`find_local` returns (held weakly: a bound method through ``WeakMethod``).
    """
    try:
        ref: weakref.ref[Any] = (
            weakref.WeakMethod(target) if inspect.ismethod(target) else weakref.ref(target)
        )
        group_ref = weakref.ref(group)
    except TypeError:  # a group (or server) without weak references: no short cut, every call is an RPC
        return
    with _LOCK:
        for key in [k for k, (g, t) in _ENTRIES.items() if g() is None or t() is None]:
            del _ENTRIES[key]  # forget dead servers and groups (their ids may be reused)
        _ENTRIES[(id(group), name)] = (group_ref, ref)


def find_local(group: object, name: str) -> Any:
    """The target registered under ``(group, name)`` in this process, or ``None`` (then use the RPC).

    ``None`` also when ``group`` is not the very object the server registered with, or it was destroyed.
    """
    with _LOCK:
        entry = _ENTRIES.get((id(group), name))
    if entry is None or entry[0]() is not group or getattr(group, "destroyed", False):
        return None
    return entry[1]()
