"""Wire format between the parent and one worker (one task pipe and one result pipe per worker).

A message is a small header pickled with the stdlib pickle (so the receiver can always read *who* it is about)
plus an optional pc_pickle payload. Payloads up to ``_INLINE`` bytes ride inside the header (one write);
larger ones follow as a second message, so a 100 MB tensor is never copied into a header.

Parent -> worker: ``(job, chunk, mode, func_blob | None, drops)`` + the arguments payload; ``EXIT`` (empty
bytes) asks the worker to leave. Worker -> parent: ``(kind, job, chunk, text)`` + a payload, where kind is one
of the ``K_*`` constants. In share mode the parent answers each ``K_OK`` reply on the (duplex) result pipe
with ``RESULT_ACK`` once it has loaded the result: the worker waits for it before its next chunk. Share mode
with the ``file_descriptor`` strategy: the result's fds follow its message as ``SCM_RIGHTS`` data (see
:mod:`pc_pool._fdpass`), counted in the envelope ``(header, blob, follows, nfds)``.
"""

from __future__ import annotations

import array
import fcntl
import multiprocessing.pool
import pickle
import termios
from collections.abc import Sequence
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
    "recv_msg",
    "send_msg",
    "unread_bytes",
]

# The stdlib's error for a result or exception that cannot travel (reprs only, so it always pickles).
MaybeEncodingError: type[Exception] = multiprocessing.pool.MaybeEncodingError  # type: ignore[attr-defined]

EXIT = b""
RESULT_ACK = b"\x01"
MODE_APPLY, MODE_MAP, MODE_STAR = 0, 1, 2
K_OK, K_ERR, K_ENC, K_READY, K_RETIRE, K_INIT_ERR = range(6)
_INLINE = 1 << 16


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


def unread_bytes(conn: Connection) -> int | None:
    """Bytes written to the pipe of ``conn`` that its reader has not consumed (Linux FIONREAD), else None."""
    try:
        buf = array.array("i", [0])
        fcntl.ioctl(conn.fileno(), termios.FIONREAD, buf)
        return int(buf[0])
    except (OSError, ValueError):  # pragma: no cover - not Linux, or closed
        return None


def recv_msg(conn: Connection) -> tuple[tuple[Any, ...], bytes | None, list[int]] | None:
    """Receive one message as ``(header, blob, fds)``; ``None`` for ``EXIT``.

    ``fds`` are the file descriptors passed with it (owned by the caller, who must close those it does not
    hand on). Raises ``EOFError`` when the peer is gone.
    """
    data = conn.recv_bytes()
    if data == EXIT:
        return None
    header, blob, follows, nfds = pickle.loads(data)
    if follows:
        blob = conn.recv_bytes()
    return header, blob, (recv_fds(conn, nfds) if nfds else [])
