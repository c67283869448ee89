"""One pool, and one result iterator, used from several threads at once: every result is the serial one."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pool_testutils as tu
import pytest

import pc_pool

THREADS = 4
CALLS = 12


def _hammer(work: Callable[[int], None]) -> None:
    """Run ``work(i)`` on ``THREADS`` threads at once; re-raise the first error."""
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS, timeout=tu.T)

    def run(i: int) -> None:
        try:
            start.wait()
            work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * tu.T)
        assert not t.is_alive()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("kind", ["fork_pool", "fork_p2p_pool", "fork_ctx_pool", "ThreadPool"])
def test_every_call_form_from_several_threads_gives_the_serial_results(
    kind: str, request: pytest.FixtureRequest
) -> None:
    if kind == "ThreadPool":
        pool: Any = pc_pool.ThreadPool(2)
    else:
        pool = request.getfixturevalue(kind)
    try:

        def work(i: int) -> None:
            for call in range(CALLS):
                items = [1000 * i + 10 * call + k for k in range(7)]
                assert pool.apply_async(tu.ident, (items[0],)).get(tu.T) == items[0]
                assert pool.map(tu.ident, items) == items
                assert pool.map_async(tu.ident, items).get(tu.T) == items
                assert list(pool.imap(tu.ident, (x for x in items))) == items
                assert sorted(pool.imap_unordered(tu.ident, iter(items))) == items

        _hammer(work)
    finally:
        if kind == "ThreadPool":
            pool.terminate()
            pool.join(tu.T)


@pytest.mark.parametrize("form", ["imap", "imap_unordered"])
def test_one_iterator_drained_by_several_threads_returns_each_result_once(fork_pool: Any, form: str) -> None:
    it = getattr(fork_pool, form)(tu.ident, (x for x in range(200)))
    taken: list[list[int]] = [[] for _ in range(THREADS)]

    def work(i: int) -> None:
        while True:
            try:
                taken[i].append(it.next(timeout=tu.T))
            except StopIteration:
                return

    _hammer(work)
    assert sorted(x for part in taken for x in part) == list(range(200))
    if form == "imap":
        for part in taken:
            assert part == sorted(part)  # in order within each thread
