"""Wire format between the parent and one worker (one task pipe and one result pipe per worker).

A message is a small header pickled with the stdlib pickle (so the receiver can always read *who* it is about)
plus an optional pc_pickle payload. Payloads up to ``_INLINE`` bytes ride inside the header (one write);
larger ones follow as a second message, so a 100 MB tensor is never copied into a header.

Parent -> worker: ``(job, chunk, mode, func_blob | None, drops)`` + the arguments payload; ``EXIT`` (empty
bytes) asks the worker to leave. Worker -> parent: ``(kind, job, chunk, text)`` + a payload, where kind is one
of the ``K_*`` constants. ``RESULT_ACK`` is kept for custom workers built on the older handshake (the parent
acknowledged each loaded share-mode result); the pool no longer sends it. Share mode with the
``file_descriptor`` strategy: the result's fds follow its message as ``SCM_RIGHTS`` data (see
:mod:`pc_pool._fdpass`), counted in the envelope ``(header, blob, follows, nfds)``.
"""

from __future__ import annotations

import array
import fcntl
import multiprocessing.pool
import os
import pickle
import struct
import termios
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from pc_pool._fdpass import recv_fds, send_fds

__all__ = [
    "EXIT",
    "K_ENC",
    "K_ERR",
    "K_INIT_ERR",
    "K_OK",
    "K_READY",
    "K_RETIRE",
    "MODE_APPLY",
    "MODE_MAP",
    "MODE_STAR",
    "RESULT_ACK",
    "MaybeEncodingError",
    "Msg",
    "decode_msg",
    "frame_msg",
    "recv_msg",
    "send_msg",
    "unread_bytes",
    "write_all",
]

# The stdlib's error for a result or exception that cannot travel (reprs only, so it always pickles).
MaybeEncodingError: type[Exception] = multiprocessing.pool.MaybeEncodingError  # type: ignore[attr-defined]

EXIT = b""
RESULT_ACK = b"\x01"
MODE_APPLY, MODE_MAP, MODE_STAR = 0, 1, 2
K_OK, K_ERR, K_ENC, K_READY, K_RETIRE, K_INIT_ERR = range(6)
_INLINE = 1 << 16
_LEN4 = struct.Struct("!i")
_LEN8 = struct.Struct("!Q")
_IOV_MAX = 512


def _framed(n: int) -> int:
    # Connection.send_bytes prefixes 4 bytes of length (12 above 2 GiB).
    return n + (4 if n <= 0x7FFFFFFF else 12)


def send_msg(conn: Connection, header: tuple[Any, ...], blob: bytes | None, fds: Sequence[int] = ()) -> int:
    """Send ``header`` and ``blob`` (inline when small, as a second message when large), then ``fds``.

    ``fds`` (share mode, result pipe only: a Unix socket pair) follow the message as ``SCM_RIGHTS`` ancillary
    data; the caller still owns (and closes) its copies.

    Returns:
        The number of bytes written to the pipe, framing included (fds excluded).
    """
    nfds = len(fds)
    if blob is not None and len(blob) > _INLINE:
        head = pickle.dumps((header, None, True, nfds), protocol=5)
        conn.send_bytes(head)
        conn.send_bytes(blob)
        sent = _framed(len(head)) + _framed(len(blob))
    else:
        head = pickle.dumps((header, blob, False, nfds), protocol=5)
        conn.send_bytes(head)
        sent = _framed(len(head))
    if nfds:
        send_fds(conn, list(fds))
    return sent


def frame_msg(header: tuple[Any, ...], blob: bytes | None) -> list[bytes]:
    """The bytes :func:`send_msg` writes for ``header`` and ``blob`` (no fds), framed as by ``send_bytes``.

    Several messages framed here can be written with one system call (see :func:`write_all`); the reader
    receives them one by one with :func:`recv_msg`.
    """
    if blob is not None and len(blob) > _INLINE:
        head = pickle.dumps((header, None, True, 0), protocol=5)
        return [_frame_head(len(head)) + head, _frame_head(len(blob)), blob]
    head = pickle.dumps((header, blob, False, 0), protocol=5)
    return [_frame_head(len(head)) + head]


def _frame_head(n: int) -> bytes:
    # Connection.send_bytes' framing: a 4-byte big-endian length, or -1 and an 8-byte length above 2 GiB.
    return _LEN4.pack(n) if n <= 0x7FFFFFFF else _LEN4.pack(-1) + _LEN8.pack(n)


def write_all(fd: int, parts: list[bytes]) -> tuple[int, OSError | None]:
    """Write ``parts`` to the blocking ``fd`` in as few system calls as the pipe allows.

    Returns:
        The number of bytes written, and the error that stopped the writing early (``None`` if none did):
        the caller tells from the count which messages went out whole.
    """
    views = [memoryview(p) for p in parts if p]
    written = 0
    while views:
        try:
            n = os.writev(fd, views[:_IOV_MAX])
        except OSError as exc:
            return written, exc
        written += n
        while n and views:
            size = views[0].nbytes
            if n >= size:
                n -= size
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0
    return written, None


def unread_bytes(conn: Connection) -> int | None:
    """Bytes written to the pipe of ``conn`` that its reader has not consumed (Linux FIONREAD), else None."""
    try:
        buf = array.array("i", [0])
        fcntl.ioctl(conn.fileno(), termios.FIONREAD, buf)
        return int(buf[0])
    except (OSError, ValueError):  # pragma: no cover - not Linux, or closed
        return None


Msg = tuple[tuple[Any, ...], bytes | None, list[int]] | None
"""One received message: ``(header, blob, fds)``, or ``None`` for ``EXIT``."""


def decode_msg(data: bytes, next_frame: Callable[[], bytes], conn: Connection) -> Msg:
    """Decode one message whose first frame is ``data``; ``next_frame`` reads the payload frame that follows.

    ``fds`` are the file descriptors passed with it, received from ``conn`` (owned by the caller, who must
    close those it does not hand on).
    """
    if data == EXIT:
        return None
    header, blob, follows, nfds = pickle.loads(data)
    if follows:
        blob = next_frame()
    return header, blob, (recv_fds(conn, nfds) if nfds else [])


def recv_msg(conn: Connection) -> Msg:
    """Receive one message as ``(header, blob, fds)``; ``None`` for ``EXIT`` (see :func:`decode_msg`).

    Raises ``EOFError`` when the peer is gone.
    """
    return decode_msg(conn.recv_bytes(), conn.recv_bytes, conn)
