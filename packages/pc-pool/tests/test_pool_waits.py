"""Waits without a timeout end on every failure: worker death, terminate(), a dead queue peer (issue 16/19).

Each wait runs in a helper thread with no timeout of its own; the test bounds only how long it waits for that
thread (``tu.T``), so a wait that does not wake fails the test instead of hanging it.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import warnings
from collections.abc import Iterator
from typing import Any

import pool_testutils as tu
import pytest

import pc_pool
from pc_pool import PoolTerminatedError, WorkerDiedError


@pytest.fixture
def executor() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    ex = concurrent.futures.ThreadPoolExecutor(4)
    try:
        yield ex
    finally:
        ex.shutdown(wait=True)


def _fork_pool(cls: Any = pc_pool.Pool) -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*multi-threaded.*fork.*", category=DeprecationWarning)
        return cls(2, share_method="cpu")


def test_pool_waits_without_timeout_wake_on_worker_death(
    fork_pool: Any, executor: concurrent.futures.ThreadPoolExecutor
) -> None:
    result = fork_pool.apply_async(tu.kill_self, (0,))
    it = fork_pool.imap(tu.kill_self, [0])
    waited = executor.submit(fork_pool.apply_async(tu.kill_self, (0,)).wait)
    got = executor.submit(result.get)
    nexted = executor.submit(it.next)
    with pytest.raises(WorkerDiedError, match="SIGKILL"):
        got.result(tu.T)
    with pytest.raises(WorkerDiedError, match="SIGKILL"):
        nexted.result(tu.T)
    assert waited.result(tu.T) is None  # wait() returns; the failure is for get() to raise


def test_pool_waits_without_timeout_wake_on_terminate_from_another_thread(
    executor: concurrent.futures.ThreadPoolExecutor,
) -> None:
    pool = _fork_pool()
    try:
        result = pool.apply_async(tu.sleep_long, (0,))
        it = pool.imap(tu.sleep_long, [0, 1])
        got = executor.submit(result.get)
        nexted = executor.submit(it.next)
        waited = executor.submit(pool.apply_async(tu.sleep_long, (0,)).wait)
        pool.close()
        joined = executor.submit(pool.join)  # close() with work pending: join(None) waits for the drain
        assert not any(f.done() for f in (got, nexted, waited, joined))  # sleep_long takes 30 s
        pool.terminate()
        with pytest.raises(PoolTerminatedError):
            got.result(tu.T)
        with pytest.raises(PoolTerminatedError):
            nexted.result(tu.T)
        assert waited.result(tu.T) is None
        assert joined.result(tu.T) is None
    finally:
        pool.terminate()


def test_pool_join_without_timeout_ends_after_a_worker_death_during_close(
    executor: concurrent.futures.ThreadPoolExecutor,
) -> None:
    pool = _fork_pool(pc_pool.P2PPool)
    try:
        result = pool.map_async(tu.kill_self, [0, 1], chunksize=1)  # both workers die, one chunk each
        pool.close()
        joined = executor.submit(pool.join)
        with pytest.raises(WorkerDiedError):
            result.get(tu.T)
        assert joined.result(tu.T) is None  # the failed chunks end the drain; no replacement keeps it open
    finally:
        pool.terminate()


# ------------------------------------------------------------------------------------------------------------
# queues
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["SimpleP2PQueue", "SimpleQueue", "MultiP2PQueue"])
def test_pool_queue_get_without_timeout_wakes_when_a_watched_sender_dies(
    kind: str, executor: concurrent.futures.ThreadPoolExecutor
) -> None:
    ctx = multiprocessing.get_context("fork")
    if kind == "SimpleQueue":  # fork locks: spawn ones would start multiprocessing's resource tracker
        q: Any = pc_pool.SimpleQueue(ctx=ctx)
    else:
        q = pc_pool.MultiP2PQueue(2) if kind == "MultiP2PQueue" else pc_pool.SimpleP2PQueue()
    sender = ctx.Process(target=tu.exit_3, args=(0,))  # dies without putting anything
    try:
        sender.start()
        got = executor.submit(q.get, watch=[sender])
        with pytest.raises(EOFError, match="watched process ended"):
            got.result(tu.T)
        sender.join(tu.T)
        assert sender.exitcode == 3
    finally:
        q.close()


def test_pool_queue_item_sent_before_the_sender_exits_is_still_delivered() -> None:
    ctx = multiprocessing.get_context("fork")
    q = pc_pool.SimpleP2PQueue()
    sender = ctx.Process(target=q.put, args=("last words",))
    try:
        sender.start()
        sender.join(tu.T)
        assert sender.exitcode == 0
        assert q.get(watch=[sender]) == "last words"  # both are ready: the item wins
        with pytest.raises(EOFError, match="watched process ended"):
            q.get(watch=[sender.sentinel])
    finally:
        q.close()


def test_pool_queue_get_wakes_when_every_writer_is_closed(
    executor: concurrent.futures.ThreadPoolExecutor,
) -> None:
    q = pc_pool.SimpleP2PQueue()
    try:
        got = executor.submit(q.get)
        q._writer.close()  # the only write end of the pipe
        with pytest.raises(EOFError):
            got.result(tu.T)
    finally:
        q.close()


@pytest.mark.parametrize("watch", [["not a process"], "abc", 3])
def test_pool_queue_bad_watch_is_a_type_error(watch: Any) -> None:
    q = pc_pool.SimpleP2PQueue()
    try:
        with pytest.raises(TypeError, match="watch"):
            q.get(0, watch=watch)
    finally:
        q.close()
