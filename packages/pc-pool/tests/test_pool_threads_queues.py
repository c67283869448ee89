"""ThreadPool, CtxThreadPool and the inter-process queues."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import threading
import warnings
from typing import Any

import pool_testutils as tu
import pytest
import torch

from pc_pool import CtxThreadPool, MultiP2PQueue, PoolTerminatedError, SimpleP2PQueue, SimpleQueue, ThreadPool

FORK = multiprocessing.get_context("fork")


def test_thread_pool_call_forms_and_reference_semantics() -> None:
    with ThreadPool(2) as pool:
        got = [tu.call(pool, form, tu.double_sum, torch.ones(10) * 2) for form in tu.FORMS]
        assert got == [40.0] * len(tu.FORMS)
        t = torch.zeros(3)
        assert pool.apply(lambda x: x.add_(1), (t,)) is t  # by reference: nothing is copied
        assert torch.equal(t, torch.ones(3))
        lock = threading.Lock()
        assert pool.apply(tu.ident, (lock,)) is lock  # no pickling at all
        with pytest.raises(ValueError, match="boom"):
            pool.apply_async(tu.raise_value_error, (1,)).get(tu.T)
        assert pool.apply_async(tu.ident, (1,), callback=_raise).get(tu.T) == 1


def _raise(value: Any) -> None:
    raise RuntimeError("callback failed")


def test_thread_pool_terminate_fails_pending_and_lifecycle() -> None:
    release = threading.Event()
    pool = ThreadPool(1)
    try:
        running = pool.apply_async(release.wait, (tu.T,))
        queued = pool.map_async(tu.ident, range(5))
        it = pool.imap(tu.ident, range(3))
        pool.terminate()
        for r in (running, queued):
            with pytest.raises(PoolTerminatedError):
                r.get(tu.T)
        with pytest.raises(PoolTerminatedError):
            it.next(timeout=tu.T)
        with pytest.raises(ValueError, match="Pool not running"):
            pool.apply(tu.ident, (1,))
    finally:
        release.set()
        pool.join(tu.T)


def test_thread_pool_close_drains_and_validation() -> None:
    pool = ThreadPool(2)
    with pytest.raises(ValueError, match="still running"):
        pool.join(1)
    r = pool.map_async(tu.ident, range(20), chunksize=3)
    pool.close()
    pool.join(tu.T)
    assert r.get(tu.T) == list(range(20))
    with pytest.raises(ValueError, match="processes must be an int >= 1"):
        ThreadPool(0)
    with pytest.raises(TypeError, match="initializer must be callable"):
        ThreadPool(1, initializer=3)
    with pytest.raises(NotImplementedError):
        pickle.dumps(pool)


def test_thread_pool_initializer_failure_breaks_pool() -> None:
    pool = ThreadPool(1, initializer=tu.failing_initializer)
    pool.join(tu.T) if pool._state.name != "RUN" else None
    with pytest.raises((ValueError, PoolTerminatedError)):
        pool.apply_async(tu.ident, (1,)).get(tu.T)
    pool.terminate()
    pool.join(tu.T)


def test_ctx_thread_pool_contexts() -> None:
    with CtxThreadPool(2, worker_contexts=["a", "b"]) as pool:
        assert set(pool.map(lambda ctx, x: ctx, range(200), chunksize=1)) <= {"a", "b"}
        assert pool.apply(lambda ctx, x, k=0: (x, k), (1,), {"k": 2}) == (1, 2)
    with CtxThreadPool(1) as pool:
        assert pool.apply(lambda ctx: ctx) is None


# ------------------------------------------------------------------------------------------------------------
# Queues
# ------------------------------------------------------------------------------------------------------------
def _put_items(q: Any, items: list[Any]) -> None:
    for item in items:
        q.put(item)


def _get_one(q: Any, out: Any) -> None:
    out.put(q.get(timeout=tu.T))


def _start(target: Any, *args: Any) -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*multi-threaded.*fork.*", category=DeprecationWarning)
        p = FORK.Process(target=target, args=args, daemon=True)
        p.start()
    return p


def test_simple_queue_many_to_many_and_timeout() -> None:
    q = SimpleQueue(ctx=FORK)
    try:
        with pytest.raises(multiprocessing.TimeoutError):
            q.get(timeout=0.05)
        producers = [_start(_put_items, q, [(i, j) for j in range(20)]) for i in range(2)]
        got = sorted(q.get(timeout=tu.T) for _ in range(40))
        assert got == sorted((i, j) for i in range(2) for j in range(20))
        for p in producers:
            p.join(tu.T)
            assert p.exitcode == 0
        q.put(lambda x: x + 1)  # lambdas travel
        assert q.get(timeout=tu.T)(1) == 2
        assert q.empty()
    finally:
        q.close()


def test_simple_queue_idle_receiver_killed_does_not_block_others() -> None:
    q = SimpleQueue(ctx=FORK)
    out = SimpleQueue(ctx=FORK)
    try:
        victim = _start(_get_one, q, out)  # blocks in get() waiting for data (without the read lock)
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(tu.T)
        survivor = _start(_get_one, q, out)
        q.put("hello")
        assert out.get(timeout=tu.T) == "hello"
        survivor.join(tu.T)
    finally:
        q.close()
        out.close()


def test_simple_queue_tensor_copy_vs_share() -> None:
    shared = SimpleQueue(ctx=FORK)
    copied = SimpleQueue(ctx=FORK, copy_tensor=True)
    try:
        t = torch.zeros(2)
        copied.put(t)
        assert not t.is_shared()
        got = copied.get(timeout=tu.T)
        got.add_(1)
        assert torch.equal(t, torch.zeros(2))
        shared.put(t)
        got = shared.get(timeout=tu.T)
        got.add_(1)
        assert torch.equal(t, torch.ones(2))
        del got
    finally:
        shared.close()
        copied.close()


def test_queues_pickle_only_while_spawning() -> None:
    for q in (SimpleQueue(ctx=FORK), SimpleP2PQueue(), MultiP2PQueue(2)):
        try:
            with pytest.raises(RuntimeError, match="inherit"):
                pickle.dumps(q)
        finally:
            q.close()


def test_p2p_queues() -> None:
    q = SimpleP2PQueue()
    m = MultiP2PQueue(3)
    try:
        p = _start(_put_items, q, [1, 2, 3])
        assert [q.get(timeout=tu.T) for _ in range(3)] == [1, 2, 3]
        p.join(tu.T)
        with pytest.raises(multiprocessing.TimeoutError):
            q.get(timeout=0.01)
        with pytest.raises(multiprocessing.TimeoutError):
            m.get(timeout=0.01)
        for i in range(6):
            m.put(i)
        assert [len((sq.reader.poll(0) and "x") or "") for sq in m.queues] == [1, 1, 1]
        assert sorted(m.get(timeout=tu.T) for _ in range(6)) == list(range(6))
        m.put_to(2, "x")
        assert m.queues[2].get(timeout=tu.T) == "x"
        assert m.empty()
        with pytest.raises(IndexError, match="queue index"):
            m.put_to(3, "y")
        with pytest.raises(ValueError, match="queue_num must be an int >= 1"):
            MultiP2PQueue(0)
    finally:
        q.close()
        m.close()
