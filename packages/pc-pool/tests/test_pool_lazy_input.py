"""Iterables are taken as in the stdlib: imap reads lazily with bounded read-ahead, map reads first."""

from __future__ import annotations

import itertools
import multiprocessing.pool
import operator
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pool_testutils as tu
import pytest

import pc_pool

KINDS = ["ThreadPool", "Pool", "P2PPool", "CtxPool"]
FORMS = ["imap", "imap_unordered"]
GUARD = 10_000  # a generator that is read this far before the caller took its results was read eagerly


def _make(kind: str) -> Any:
    if kind == "ThreadPool":
        return pc_pool.ThreadPool(2)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*multi-threaded.*fork.*", category=DeprecationWarning)
        if kind == "CtxPool":
            return pc_pool.CtxPool(2, worker_contexts=[0, 1], share_method="cpu")
        return getattr(pc_pool, kind)(2, share_method="cpu")


@pytest.fixture(params=KINDS)
def own_pool(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh 2-worker pool of each kind, terminated and joined after the test."""
    pool = _make(request.param)
    try:
        yield pool
    finally:
        pool.terminate()
        pool.join(tu.T)


class Counting:
    """``count()`` that records how far it was read; it refuses to go past ``GUARD`` (an eager read)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.produced = 0
        self.fail_at = fail_at

    def __iter__(self) -> Iterator[int]:
        for i in itertools.count():
            if i == self.fail_at:
                raise KeyError(f"element {i}")
            if i >= GUARD:
                raise AssertionError(f"the iterable was read to element {GUARD} before any result was taken")
            self.produced = i + 1
            yield i


def _take(it: Any, n: int) -> list[Any]:
    return [it.next(timeout=tu.T) for _ in range(n)]


@pytest.mark.parametrize("chunksize", [1, 4])
@pytest.mark.parametrize("form", FORMS)
def test_imap_over_an_endless_iterable_yields_at_once_with_bounded_read_ahead(
    own_pool: Any, form: str, chunksize: int
) -> None:
    # any chunksize streams, as the stdlib's imap does (a chunksize > 1 once meant an eager map)
    source = Counting()
    it = getattr(own_pool, form)(tu.ident, iter(source), chunksize=chunksize)
    first = _take(it, 5)
    assert source.produced <= 5 + 8 * own_pool.size()  # the documented read-ahead bound
    if form == "imap":
        assert first == [0, 1, 2, 3, 4]
    else:
        assert len(set(first)) == 5
        assert set(first) <= set(range(source.produced))
    first_more = _take(it, 20)
    assert len(first_more) == 20
    assert source.produced <= 25 + 8 * own_pool.size()


@pytest.mark.parametrize("chunksize", [1, 4])
@pytest.mark.parametrize("form", FORMS)
def test_imap_yields_the_elements_before_the_iterable_fails_then_its_error(
    own_pool: Any, form: str, chunksize: int
) -> None:
    it = getattr(own_pool, form)(tu.ident, iter(Counting(fail_at=3)), chunksize=chunksize)
    got = _take(it, 3)
    assert sorted(got) == [0, 1, 2]
    with pytest.raises(KeyError, match="element 3"):
        it.next(timeout=tu.T)
    with pytest.raises(StopIteration):
        it.next(timeout=tu.T)


@pytest.mark.parametrize("form", FORMS)
def test_imap_over_an_empty_or_short_generator(own_pool: Any, form: str) -> None:
    assert list(getattr(own_pool, form)(tu.ident, iter(()))) == []
    assert sorted(getattr(own_pool, form)(tu.ident, (x for x in range(7)))) == list(range(7))


def test_close_then_join_drains_a_lazy_imap_nobody_reads(own_pool: Any) -> None:
    it = own_pool.imap(tu.ident, (x for x in range(100)))
    own_pool.close()
    own_pool.join(tu.T)
    assert list(it) == list(range(100))
    assert len(it) == 100


def test_terminate_ends_the_input_thread(own_pool: Any) -> None:
    it = own_pool.imap(tu.ident, iter(Counting()))
    _take(it, 1)
    inputs = [t for t in threading.enumerate() if t.name == "pc_pool-imap-input"]
    assert inputs
    own_pool.terminate()
    with pytest.raises(pc_pool.PoolTerminatedError):
        _take(it, 100)
    for thread in inputs:
        thread.join(tu.T)
        assert not thread.is_alive()


def _failing() -> Iterator[tuple[int, int]]:
    yield (1, 2)
    raise KeyError("element 1")


@pytest.mark.parametrize("method", ["map", "map_async", "starmap", "starmap_async"])
def test_map_reads_the_iterable_first_and_raises_its_error_like_the_stdlib(method: str) -> None:
    func = operator.add if method.startswith("star") else tu.ident
    with multiprocessing.pool.ThreadPool(1) as std, pytest.raises(KeyError, match="element 1"):
        getattr(std, method)(func, _failing())
    with pc_pool.ThreadPool(1) as pool, pytest.raises(KeyError, match="element 1"):
        getattr(pool, method)(func, _failing())


def test_a_terminated_lazy_imap_raises_after_its_results_and_never_ends_quietly(own_pool: Any) -> None:
    more = threading.Event()

    def three_then_more() -> Iterator[int]:
        yield from range(3)
        more.wait(tu.T)  # the pool is terminated while the input thread waits here
        yield from range(3, 10)

    it = own_pool.imap(tu.ident, three_then_more())
    assert _take(it, 3) == [0, 1, 2]  # every element read so far has been answered and taken
    inputs = [t for t in threading.enumerate() if t.name == "pc_pool-imap-input"]
    own_pool.terminate()
    more.set()
    for thread in inputs:
        thread.join(tu.T)
        assert not thread.is_alive()
    with pytest.raises(pc_pool.PoolTerminatedError):
        it.next(timeout=tu.T)


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("form", FORMS)
def test_imap_sends_chunksize_elements_per_task(own_pool: Any, form: str, lazy: bool) -> None:
    # One task per chunk: the elements of a chunk run in one worker (thread), one call after the other.
    source: Any = (x for x in range(40)) if lazy else list(range(40))
    chunks: dict[tuple[int, int], list[int]] = {}
    for pid, thread, seq in getattr(own_pool, form)(tu.where_and_when, source, chunksize=4):
        chunks.setdefault((pid, thread), []).append(seq)
    assert sum(len(seqs) for seqs in chunks.values()) == 40
    for seqs in chunks.values():
        seqs.sort()
        runs = [seqs[i : i + 4] for i in range(0, len(seqs), 4)]
        # every worker ran whole chunks: its calls come in runs of 4 starting at a multiple of 4
        assert all(run == list(range(run[0], run[0] + 4)) and run[0] % 4 == 0 for run in runs), seqs


@pytest.mark.parametrize("lazy", [False, True])
def test_imap_a_failed_chunk_raises_once_in_place_of_its_results(own_pool: Any, lazy: bool) -> None:
    # The chunk holding the failing element raises once; the next chunks follow (the stdlib's chunked imap
    # raises once too, then stops: its results come through a generator that the exception ends).
    source: Any = iter(range(10)) if lazy else list(range(10))
    it = own_pool.imap(tu.raise_on_3, source, chunksize=4)
    with pytest.raises(ValueError, match="element 3"):
        it.next(timeout=tu.T)
    assert [it.next(timeout=tu.T) for _ in range(6)] == [4, 5, 6, 7, 8, 9]
    with pytest.raises(StopIteration):
        it.next(timeout=tu.T)


def test_imap_reads_ahead_at_most_one_large_chunk(own_pool: Any) -> None:
    source = Counting()
    it = own_pool.imap(tu.ident, iter(source), chunksize=50)
    assert _take(it, 1) == [0]
    # the first chunk is taken (being returned), one more may be read: max(8 * processes, chunksize) ahead
    assert source.produced <= 50 + max(8 * own_pool.size(), 50)
