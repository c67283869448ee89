"""Share mode, ``file_descriptor`` strategy: a worker's result fds travel with the result (``SCM_RIGHTS``).

torch shares a CPU storage as an fd that the loading process normally fetches from the *producer* through
multiprocessing's ``resource_sharer`` when it loads the payload, so a worker killed between sending a result
and the parent loading it took that finished result with it. Here the worker dumps its result with a
collector installed as multiprocessing's "spawning popen" (the hook ``multiprocessing.reduction.DupFd``
consults, which torch's ``reduce_storage`` calls): each fd is dup'd into a list and the payload holds a
:class:`PassedFd` (its index) instead of a ``resource_sharer`` address. The fds are then sent over the result
pipe (a Unix socket pair in share mode) right after the message, so once sent they are held by the kernel and
then by the parent, independent of the worker's lifetime. The parent installs the received fds around the
load (:func:`installed_fds`); ``PassedFd.detach()`` hands each over and whatever is not taken is closed.

The ``file_system`` strategy shares names, not fds: nothing is collected and nothing is passed.
"""

from __future__ import annotations

import contextlib
import multiprocessing.context
import multiprocessing.reduction
import os
import socket
import threading
from collections.abc import Iterable, Iterator
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["PassedFd", "close_fds", "collecting_fds", "installed_fds", "recv_fds", "send_fds"]

_MAX_FDS = 250  # per sendmsg: Linux refuses more than SCM_MAX_FD (253) fds in one message
_local = threading.local()


class PassedFd:
    """Stands, inside a payload, for the ``index``-th fd passed along with the message that carries it.

    Args:
        index: Position of the fd in the message's fd list.
    """

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Any, ...]:
        return (PassedFd, (self.index,))

    def detach(self) -> int:
        """Take ownership of the fd (the caller closes it), as ``resource_sharer.DupFd.detach`` does.

        Raises:
            OSError: No such fd was passed with this payload, or it was taken already (a second load).
        """
        received: list[int] | None = getattr(_local, "fds", None)
        if received is None or not 0 <= self.index < len(received) or received[self.index] < 0:
            raise OSError(f"fd #{self.index} of this payload was not passed with it, or was taken already")
        fd = received[self.index]
        received[self.index] = -1
        return fd


class _FdCollector:
    """The "spawning popen" seen by ``multiprocessing.reduction.DupFd`` while a result is dumped."""

    def __init__(self) -> None:
        self.fds: list[int] = []

    def duplicate_for_child(self, fd: int) -> int:
        self.fds.append(os.dup(fd))
        return len(self.fds) - 1

    def DupFd(self, index: int) -> PassedFd:  # noqa: N802 - the name multiprocessing.reduction calls
        return PassedFd(index)


@contextlib.contextmanager
def collecting_fds() -> Iterator[list[int]]:
    """While active in this thread, shared fds dumped here are dup'd into the yielded list (caller owns)."""
    collector = _FdCollector()
    previous = multiprocessing.context.get_spawning_popen()
    multiprocessing.context.set_spawning_popen(collector)  # type: ignore[arg-type]  # duck-typed by DupFd
    try:
        yield collector.fds
    finally:
        multiprocessing.context.set_spawning_popen(previous)


@contextlib.contextmanager
def installed_fds(fds: list[int]) -> Iterator[None]:
    """Make ``fds`` the fds that :class:`PassedFd` hands over in this thread; close those not taken after."""
    table = list(fds)
    previous = getattr(_local, "fds", None)
    _local.fds = table
    try:
        yield
    finally:
        _local.fds = previous
        close_fds(table)


def close_fds(fds: Iterable[int]) -> None:
    """Close every fd of ``fds`` that is not ``-1`` (taken)."""
    for fd in fds:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


def _socket_of(conn: Connection) -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=os.dup(conn.fileno()))


def send_fds(conn: Connection, fds: list[int]) -> None:
    """Send ``fds`` over the Unix socket of ``conn``, ``_MAX_FDS`` per message (see :func:`recv_fds`)."""
    with _socket_of(conn) as sock:
        for start in range(0, len(fds), _MAX_FDS):
            multiprocessing.reduction.sendfds(sock, fds[start : start + _MAX_FDS])


def recv_fds(conn: Connection, count: int) -> list[int]:
    """Receive the ``count`` fds sent by :func:`send_fds`; they are owned by the caller.

    Raises:
        EOFError: The peer closed the connection first.
        RuntimeError: The stream did not hold fds where expected.
    """
    fds: list[int] = []
    with _socket_of(conn) as sock:
        try:
            while len(fds) < count:
                fds.extend(multiprocessing.reduction.recvfds(sock, min(_MAX_FDS, count - len(fds))))
        except BaseException:
            close_fds(fds)
            raise
    return fds
