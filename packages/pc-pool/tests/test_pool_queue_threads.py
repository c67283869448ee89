"""Every queue shared by the threads of one process: each message arrives once, whole (never interleaved)."""

from __future__ import annotations

import multiprocessing
import threading
from collections import Counter
from typing import Any

import pytest

from pc_pool import MultiP2PQueue, SimpleP2PQueue, SimpleQueue

_T = 60.0
WRITERS, READERS, PER_WRITER = 4, 3, 25
SIZE = (
    200_000  # larger than a pipe's buffer: one message takes several writes, which threads could interleave
)


def _payload(writer: int, index: int) -> bytes:
    return bytes([writer * 37 + index & 0xFF]) * SIZE


def _queue(kind: str) -> Any:
    if kind == "SimpleP2PQueue":
        return SimpleP2PQueue(copy_tensor=True)
    if kind == "MultiP2PQueue":
        return MultiP2PQueue(3, copy_tensor=True)
    return SimpleQueue(ctx=multiprocessing.get_context("fork"), copy_tensor=True)  # no resource tracker


@pytest.mark.parametrize("kind", ["SimpleP2PQueue", "MultiP2PQueue", "SimpleQueue"])
def test_threads_put_and_get_every_message_once_and_whole(kind: str) -> None:
    queue = _queue(kind)
    got: list[tuple[int, int, bytes]] = []
    got_lock = threading.Lock()
    errors: list[BaseException] = []
    total = WRITERS * PER_WRITER
    remaining = [total]

    def write(writer: int) -> None:
        try:
            for index in range(PER_WRITER):
                queue.put((writer, index, _payload(writer, index)))
        except BaseException as exc:  # pragma: no cover - only on failure
            errors.append(exc)

    def read() -> None:
        try:
            while True:
                with got_lock:
                    if remaining[0] == 0:
                        return
                    remaining[0] -= 1  # this thread will take one more message
                item = queue.get(timeout=_T)
                with got_lock:
                    got.append(item)
        except BaseException as exc:  # pragma: no cover - only on failure
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(WRITERS)]
    threads += [threading.Thread(target=read) for _ in range(READERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(2 * _T)
    queue.close()
    assert errors == []
    assert not any(thread.is_alive() for thread in threads)
    assert Counter((w, i) for w, i, _ in got) == Counter(
        (w, i) for w in range(WRITERS) for i in range(PER_WRITER)
    )
    assert all(data == _payload(w, i) for w, i, data in got)  # whole: no bytes of another message inside
