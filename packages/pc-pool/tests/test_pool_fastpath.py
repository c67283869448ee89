"""The fast paths of issue 20: batched task writes, bulk result reads, an apply sent by its caller thread."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pool_testutils as tu
import pytest

import pc_pool
from pc_pool._protocol import frame_msg, recv_msg, write_all
from pc_pool._reader import ResultReader


def _ident(x: Any) -> Any:
    return x


def _pipe() -> tuple[Any, Any]:
    import multiprocessing

    return multiprocessing.get_context("fork").Pipe(duplex=False)


def test_pool_frames_written_together_read_one_by_one() -> None:
    # frame_msg + write_all must produce exactly what send_msg frames: the worker reads with recv_msg.
    r, w = _pipe()
    try:
        big = b"x" * (70 * 1024)  # above the inline limit: the payload follows as its own frame
        parts = [*frame_msg((1, 0, 1, None, ()), b"small"), *frame_msg((1, 1, 1, None, ()), big)]
        written, error = write_all(w.fileno(), parts[:1])
        assert (written, error) == (len(parts[0]), None)
        thread = threading.Thread(target=write_all, args=(w.fileno(), parts[1:]))
        thread.start()  # 70 KB exceeds the pipe buffer: the reader drains it meanwhile
        first = recv_msg(r)
        second = recv_msg(r)
        thread.join(tu.T)
        assert first == ((1, 0, 1, None, ()), b"small", [])
        assert second == ((1, 1, 1, None, ()), big, [])
    finally:
        r.close()
        w.close()


def test_pool_write_all_reports_what_went_out_before_the_reader_died() -> None:
    r, w = _pipe()
    r.close()
    try:
        written, error = write_all(w.fileno(), frame_msg((1, 0, 1, None, ()), b"abc"))
        assert written == 0
        assert isinstance(error, BrokenPipeError)
    finally:
        w.close()


def test_pool_bulk_reader_cuts_frames_and_keeps_messages_read_before_eof() -> None:
    r, w = _pipe()
    reader = ResultReader(r, bulk=True)
    try:
        big = os.urandom(200 * 1024)  # longer than one bulk read: completed in place
        msgs = [((0, 1, i, None), b"\x00" + bytes([i])) for i in range(5)]
        for header, blob in msgs:
            w.send_bytes(frame_msg(header, blob)[0][4:])  # the same frames as send_msg
        out: list[Any] = []
        reader.drain(256, out)
        assert out == [(h, b, []) for h, b in msgs]
        assert not reader.pending()
        thread = threading.Thread(target=write_all, args=(w.fileno(), frame_msg((0, 2, 0, None), big)))
        thread.start()
        assert reader.recv() == ((0, 2, 0, None), big, [])
        thread.join(tu.T)
        last = frame_msg((0, 3, 0, None), b"last")[0]
        cut = frame_msg((0, 4, 0, None), b"never finished")[0][:10]
        write_all(w.fileno(), [last, cut])  # then the worker dies in the middle of its next message
        w.close()
        out = []
        with pytest.raises(EOFError):
            reader.drain(256, out)
        assert out == [((0, 3, 0, None), b"last", [])]  # read before the EOF: not lost
    finally:
        r.close()
        if not w.closed:
            w.close()


def test_pool_apply_to_an_idle_worker_is_sent_by_the_calling_thread(fork_pool: pc_pool.Pool) -> None:
    senders: list[str] = []
    real = fork_pool._worker_set.send_batch

    def recording(index: int, messages: list[Any]) -> list[int]:
        senders.append(threading.current_thread().name)
        return real(index, messages)

    fork_pool._worker_set.send_batch = recording  # type: ignore[method-assign]
    fork_pool._feeder._send_batch = recording
    try:
        fork_pool.map(_ident, range(4))  # wait until every worker is idle again
        senders.clear()
        assert fork_pool.apply(_ident, (7,)) == 7
        assert senders == [threading.current_thread().name]
    finally:
        fork_pool._feeder._send_batch = real
        del fork_pool._worker_set.send_batch


def _die_on(x: int) -> int:
    if x == 13:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def test_pool_many_tiny_tasks_with_a_death_fail_only_that_task() -> None:
    # Deep windows and batched writes: a worker killed mid-stream fails exactly its running element; every
    # other element, queued in its pipe or not, is answered.
    with pc_pool.Pool(2, share_method="cpu") as pool:
        it = pool.imap(_die_on, range(400))
        values, died = [], []
        for x in range(400):
            try:
                values.append(it.next(tu.T))
            except pc_pool.WorkerDiedError:
                died.append(x)
        assert died == [13]
        assert values == [x for x in range(400) if x != 13]
