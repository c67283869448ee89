"""The parent's reader of one worker's result pipe: whole messages, many per system call when it may.

Copy mode (a plain pipe, no fds travel): :class:`ResultReader` reads what the pipe holds in one ``os.read``
of up to ``_CHUNK`` bytes and cuts it into ``send_bytes`` frames itself, so a burst of small replies costs
one system call instead of two per reply plus a readiness check each (``Connection.recv_bytes`` reads the
4-byte length and the body separately). A frame cut short by the read is completed with blocking reads, as
``recv_bytes`` would (its writer is in the middle of writing it). Share mode (a Unix socket whose messages
may carry fds as ancillary data, which a plain read would drop) reads message by message with
:func:`~pc_pool._protocol.recv_msg`.

Every read of a result pipe in the parent goes through its handle's reader: bytes it has buffered are
invisible to ``poll``, so :meth:`ResultReader.drain` is called until :meth:`ResultReader.pending` is false.
"""

from __future__ import annotations

import os
import select
import struct
from multiprocessing.connection import Connection

from pc_pool._protocol import Msg, decode_msg, recv_msg

__all__ = ["ResultReader"]

_CHUNK = 1 << 16
_LEN4 = struct.Struct("!i")
_LEN8 = struct.Struct("!Q")


class ResultReader:
    """Reads ``(header, payload, fds)`` messages (``None`` for ``EXIT``) from one result connection.

    Args:
        conn: The parent's end of the worker's result pipe.
        bulk: Read many messages per system call (copy mode: no fds travel on this pipe).
    """

    def __init__(self, conn: Connection, *, bulk: bool) -> None:
        self._conn = conn
        self._bulk = bulk
        self._buf = bytearray()
        self._poller = select.poll()
        self._poller.register(conn.fileno(), select.POLLIN)

    def pending(self) -> bool:
        """Whether bytes are buffered here (``poll`` on the pipe cannot see them)."""
        return bool(self._buf)

    def readable(self) -> bool:
        """Whether a message (or EOF) can be read now without waiting for the worker."""
        return bool(self._buf) or bool(self._poller.poll(0))

    def recv(self) -> Msg:
        """Receive one message, waiting for it if needed; raises ``EOFError`` when the worker is gone."""
        if not self._bulk:
            return recv_msg(self._conn)
        return decode_msg(self._frame(), self._frame, self._conn)

    def drain(self, limit: int, out: list[Msg]) -> None:
        """Append to ``out`` the message the pipe holds (blocking for it) and every other one it holds now.

        Messages are appended as they arrive, so those read before an ``EOFError`` (the worker died) stay in
        ``out``. ``limit`` bounds a share-mode burst (a chatty worker cannot starve the others); in copy mode
        everything buffered is taken (one read, at most ``_CHUNK`` bytes), so nothing stays invisible to
        ``poll``.
        """
        out.append(self.recv())
        if not self._bulk:
            n = 1
            while n < limit and self.readable():
                out.append(self.recv())
                n += 1
            return
        while self._buf:
            out.append(self.recv())

    # -- frames ----------------------------------------------------------------------------------------------
    def _read(self, n: int) -> None:
        data = os.read(self._conn.fileno(), n)
        if not data:
            raise EOFError("the worker's result pipe was closed")
        self._buf += data

    def _need(self, n: int) -> None:
        """Block until at least ``n`` bytes are buffered."""
        while len(self._buf) < n:
            self._read(max(n - len(self._buf), _CHUNK))

    def _frame(self) -> bytes:
        if not self._buf:
            self._read(_CHUNK)
        self._need(4)
        (size,) = _LEN4.unpack_from(self._buf)
        start = 4
        if size == -1:
            self._need(12)
            (size,) = _LEN8.unpack_from(self._buf, 4)
            start = 12
        if size > _CHUNK and len(self._buf) < start + size:
            return self._large_frame(start, size)
        self._need(start + size)
        data = bytes(self._buf[start : start + size])
        del self._buf[: start + size]
        return data

    def _large_frame(self, start: int, size: int) -> bytes:
        """A frame longer than the buffer: read the rest straight into place (one copy, as recv_bytes)."""
        out = bytearray(size)
        view = memoryview(out)
        have = len(self._buf) - start
        view[:have] = self._buf[start:]
        self._buf.clear()
        fd = self._conn.fileno()
        while have < size:
            n = os.readv(fd, [view[have:]])
            if n == 0:
                raise EOFError("the worker's result pipe was closed")
            have += n
        view.release()
        return bytes(out)
