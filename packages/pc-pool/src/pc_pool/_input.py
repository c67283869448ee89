"""The input thread of ``imap``/``imap_unordered`` over a lazy iterable: bounded read-ahead, as in the stdlib.

The stdlib's pools hand a generator to a thread and return at once, so ``imap`` over an endless generator
yields its first results, and a generator that raises at item k yields items 0..k-1 before the error. One
input thread per such call does the same here: it reads ``chunksize`` elements at a time and queues them as
one chunk of the call's job (a shorter last chunk when the iterable ends or raises). Unlike the stdlib, it
reads at most ``max(8 * processes, chunksize)`` elements past the last result the caller took, so an
endless or huge iterable holds bounded memory; once the pool is closed the bound is lifted (the
rest of the input drains, as ``close()`` promises, without the caller reading results). The thread ends when
the iterable is exhausted or raises, when the job can take no more (the pool was terminated or broke), or
when the result handle failed.

Lists, tuples and ranges are not read by a thread: they are already in memory and are queued at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from pc_pool._settings import TICK
from pc_pool._signals import start_with_sigint_blocked

__all__ = ["READ_AHEAD_PER_WORKER", "LazyResult", "read_ahead_chunks", "start_input_thread"]

# Elements read past the caller's position, per worker of the pool: enough to keep every worker's window busy.
READ_AHEAD_PER_WORKER = 8


def read_ahead_chunks(processes: int, chunksize: int) -> int:
    """Chunks the input thread may read past the caller's.

    ``READ_AHEAD_PER_WORKER * processes`` elements, and at least one chunk: at most
    ``max(8 * processes, chunksize)`` elements are read ahead.
    """
    return max(1, READ_AHEAD_PER_WORKER * processes // chunksize)


class LazyResult(Protocol):
    """What the input thread needs of the result handle (:class:`~pc_pool.IMapIterator`)."""

    def _wait_for_room(self, count: int, read_ahead: int, timeout: float) -> bool | None: ...

    def _end_input(self, chunks: int, length: int, error: BaseException | None) -> bool: ...


def start_input_thread(
    iterator: Iterator[Any],
    result: LazyResult,
    add: Callable[[int, list[Any]], bool],
    end: Callable[[bool], None],
    read_ahead: int,
    chunksize: int = 1,
) -> threading.Thread:
    """Start the thread that reads ``iterator`` into one job.

    Args:
        iterator: The caller's elements.
        result: The job's result handle; it bounds the read-ahead and learns the final count (unless the job
            was failed first: then its handle raises that failure after the results that arrived, never a
            ``StopIteration`` that would pass a cut-short input off as complete).
        add: Queues chunk ``index`` (a list of elements); False when the job takes no more.
        end: Called once at the end with whether the job is complete (every result arrived).
        read_ahead: Chunks read at most past the last chunk the caller took (:func:`read_ahead_chunks`).
        chunksize: Elements per chunk.

    Returns:
        The started daemon thread.
    """
    thread = threading.Thread(
        target=_read,
        args=(iterator, result, add, end, read_ahead, chunksize),
        name="pc_pool-imap-input",
        daemon=True,
    )
    start_with_sigint_blocked(thread)
    return thread


def _read(
    iterator: Iterator[Any],
    result: LazyResult,
    add: Callable[[int, list[Any]], bool],
    end: Callable[[bool], None],
    read_ahead: int,
    chunksize: int,
) -> None:
    chunks = length = 0
    error: BaseException | None = None
    cut_short = True  # the job was failed (terminate, a broken pool): its handle reports that, not an end
    try:
        while error is None:
            room = result._wait_for_room(chunks, read_ahead, TICK)
            if room is None:
                continue  # TICK passed: re-check (a backstop; every change notifies)
            if not room:
                break
            items: list[Any] = []
            ended = False
            try:
                while len(items) < chunksize:
                    items.append(next(iterator))
            except StopIteration:
                ended = True
            except Exception as exc:  # the caller's iterable failed: its results so far, then this error
                error = exc
            if items:
                if not add(chunks, items):
                    break
                chunks += 1
                length += len(items)
            if ended or error is not None:
                cut_short = False
                break
    finally:
        end(False if cut_short else result._end_input(chunks, length, error))
