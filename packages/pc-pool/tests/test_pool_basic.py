"""Happy paths of the process pools (values from machin's tests), tensor copy vs share, lifecycle, checks."""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import signal
import warnings
import weakref
from typing import Any

import pool_testutils as tu
import pytest
import torch

import pc_pool
from pc_pool import CtxPool, P2PPool, Pool, PoolStates


def _fork(factory: Any, *args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*multi-threaded.*fork.*", category=DeprecationWarning)
        return factory(*args, **kwargs)


@pytest.mark.parametrize("form", tu.FORMS)
def test_pool_all_call_forms_give_machin_values(any_pool: Any, form: str) -> None:
    got = [tu.call(any_pool, form, tu.double_sum, torch.ones(10) * i) for i in range(5)]
    assert got == [0, 20, 40, 60, 80]


def test_pool_batch_forms_and_closures(any_pool: Any) -> None:
    ctx = tu.is_ctx(any_pool)
    base = torch.ones(10)

    def closure(*args: Any) -> float:
        return float((base * args[-1]).sum())

    tensors = [torch.ones(10) * i for i in range(5)]
    assert any_pool.map(tu.double_sum, tensors) == [0, 20, 40, 60, 80]
    assert any_pool.starmap(tu.double_sum, [(t,) for t in tensors]) == [0, 20, 40, 60, 80]
    assert any_pool.map(closure, range(1, 6)) == [10, 20, 30, 40, 50]
    assert any_pool.map(lambda *a: a[-1] + 1, range(100), chunksize=7) == list(range(1, 101))
    assert list(any_pool.imap(tu.ident, range(10), chunksize=3)) == list(range(10))  # streams, any chunksize
    assert sorted(any_pool.imap_unordered(tu.ident, range(10))) == list(range(10))
    assert any_pool.map(tu.ident, []) == []
    assert list(any_pool.imap(tu.ident, [])) == []
    kw = any_pool.apply(lambda *a, k=0: (a[-1], k), (1,), {"k": 2})
    assert kw == (1, 2)
    assert any_pool.size() == 2
    if not ctx:
        assert any_pool.starmap(lambda a, b: a * b, [(1, 2), (3, 4)]) == [2, 12]


def test_pool_apply_async_then_map_and_callbacks(fork_pool: Pool) -> None:
    seen: list[Any] = []
    r = fork_pool.apply_async(tu.ident, (5,), callback=seen.append)
    assert fork_pool.map(tu.ident, range(3)) == [0, 1, 2]
    assert r.get(tu.T) == 5
    assert r.successful()
    assert seen == [5]
    m = fork_pool.map_async(tu.ident, range(4), callback=seen.append)
    m.wait(tu.T)
    assert m.ready()
    assert seen[-1] == [0, 1, 2, 3]
    errors: list[BaseException] = []
    e = fork_pool.apply_async(tu.raise_value_error, (1,), error_callback=errors.append)
    e.wait(tu.T)
    assert not e.successful()
    assert isinstance(errors[0], ValueError)
    never_filled = pc_pool.AsyncResult(-1, {})
    with pytest.raises(ValueError, match="not ready"):
        never_filled.successful()
    with pytest.raises(multiprocessing.TimeoutError):
        never_filled.get(0.01)


def test_pool_copy_tensor_isolates_caller(fork_pool: Pool) -> None:
    t = torch.zeros(4)
    out = fork_pool.apply(lambda x: x.add_(1), (t,))
    assert not t.is_shared()
    assert torch.equal(t, torch.zeros(4))  # the worker wrote to its copy
    assert torch.equal(out, torch.ones(4))
    assert not out.is_shared()


def test_pool_share_cpu_tensor_writes_show() -> None:
    with _fork(Pool, 2, is_copy_tensor=False, share_method="cpu") as pool:
        t = torch.zeros(4)
        pool.apply(lambda x: x.add_(1), (t,))
        assert t.is_shared()
        assert torch.equal(t, torch.ones(4))
        out = pool.apply(lambda: torch.full((3,), 7.0))
        assert torch.equal(out, torch.full((3,), 7.0))
        del out


def test_pool_spawn_copies_tensors(spawn_pool: Pool) -> None:
    t = torch.zeros(4)
    out = spawn_pool.apply(lambda x: x.add_(2), (t,))
    assert torch.equal(t, torch.zeros(4))
    assert torch.equal(out, torch.full((4,), 2.0))


def test_pool_function_loaded_once_per_job_and_worker(fork_pool: Pool) -> None:
    tu.CountingFunc.loads = 0
    results = fork_pool.map(tu.CountingFunc(), range(40), chunksize=1)
    per_pid: dict[int, set[int]] = {}
    for pid, loads in results:
        per_pid.setdefault(pid, set()).add(loads)
    assert per_pid
    assert all(counts == {next(iter(counts))} for counts in per_pid.values())
    # A second job loads its function at most once more per worker (an identical copied payload is reused).
    again = fork_pool.map(tu.CountingFunc(), range(40), chunksize=1)
    for pid, loads in again:
        if pid in per_pid:
            assert loads <= next(iter(per_pid[pid])) + 1


def test_ctx_pool_contexts_are_isolated_between_pools() -> None:
    a = _fork(CtxPool, 2, worker_contexts=[0, 1], share_method="cpu")
    b = _fork(CtxPool, 2, worker_contexts=[2, 3], share_method="cpu")
    try:
        ra = a.map_async(lambda ctx, x: ctx, range(50_000))
        rb = b.map_async(lambda ctx, x: ctx, range(50_000))
        assert set(ra.get(tu.T)) <= {0, 1}
        assert set(rb.get(tu.T)) <= {2, 3}
        assert a.apply(lambda ctx: pc_pool.CtxPoolStorage.storage == ctx) is True
    finally:
        a.terminate()
        b.terminate()


def test_ctx_pool_replacement_worker_keeps_its_context() -> None:
    with _fork(CtxPool, 2, worker_contexts=["a", "b"], share_method="cpu") as pool:
        os.kill(pool._workers[0].process.pid, signal.SIGKILL)
        contexts = set(pool.map(lambda ctx, x: ctx, range(200), chunksize=1))
        assert contexts <= {"a", "b"}
        assert pool.size() == 2


def test_ctx_pool_without_contexts_passes_none(fork_pool: Pool) -> None:
    with _fork(CtxPool, 1, share_method="cpu") as pool:
        assert pool.apply(lambda ctx, x: (ctx, x), (1,)) == (None, 1)
        assert pc_pool.proxy_ctx_caller(lambda ctx, x: (ctx, x), 3) == (None, 3)


def test_p2p_pool_sends_chunk_k_to_worker_k_mod_n(fork_p2p_pool: P2PPool) -> None:
    pids = fork_p2p_pool.map(tu.getpid, range(8), chunksize=1)
    assert len(set(pids)) == 2
    assert all(pids[k] == pids[k % 2] for k in range(8))


def test_p2p_pool_close_drains_pending_work() -> None:
    pool = _fork(P2PPool, 2, share_method="cpu")
    result = pool.map_async(tu.ident, range(100), chunksize=1)
    pool.close()
    pool.join(tu.T)
    assert result.get(tu.T) == list(range(100))
    assert pool._state is PoolStates.CLOSE


def test_pool_close_join_lifecycle() -> None:
    pool = _fork(Pool, 2, share_method="cpu")
    with pytest.raises(ValueError, match="still running"):
        pool.join(1)
    r = pool.map_async(tu.ident, range(50))
    pool.close()
    for call in (
        lambda: pool.apply(tu.ident, (1,)),
        lambda: pool.map(tu.ident, [1]),
        lambda: pool.imap(tu.ident, [1]),
    ):
        with pytest.raises(ValueError, match="Pool not running"):
            call()
    pool.join(tu.T)
    assert r.get(tu.T) == list(range(50))
    pool.terminate()  # idempotent after join


def test_pool_maxtasksperchild_retires_without_errors() -> None:
    with _fork(Pool, 2, maxtasksperchild=1, share_method="cpu") as pool:
        results = pool.map(tu.getpid, range(50), chunksize=1)
        assert len(results) == 50
        assert len(set(results)) > 2  # workers were replaced
        assert pool.map(tu.ident, range(50), chunksize=1) == list(range(50))


@pytest.mark.parametrize("daemon", [True, False])
def test_pool_inside_a_task(fork_pool: Pool, daemon: bool) -> None:
    with _fork(Pool, 1, share_method="cpu", is_daemon=daemon) as outer:
        result = outer.apply_async(tu.make_pool_in_task, (daemon,))
        if daemon:
            with pytest.raises(AssertionError, match="daemonic"):
                result.get(tu.T)
        else:
            assert result.get(tu.T) == 7


def test_pool_cannot_be_pickled(fork_pool: Pool) -> None:
    with pytest.raises(NotImplementedError):
        pickle.dumps(fork_pool)


def test_pool_base_pool_defaults_to_spawn() -> None:
    assert pc_pool.BasePool.__init__.__defaults__ is not None
    # BasePool(context=None) must mean spawn; checked without starting workers via a bad argument.
    with pytest.raises(ValueError, match="processes must be an int >= 1"):
        pc_pool.BasePool(0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"processes": 0}, ValueError, "processes must be an int >= 1, got 0"),
        ({"processes": "2"}, TypeError, "processes must be an int"),
        ({"maxtasksperchild": 0}, ValueError, "maxtasksperchild must be None or an int >= 1, got 0"),
        ({"maxtasksperchild": -1}, ValueError, "got -1"),
        ({"initializer": 3}, TypeError, "initializer must be callable"),
        ({"share_method": "gpu"}, ValueError, "share_method must be"),
        ({"is_copy_tensor": False}, ValueError, "needs share_method"),
    ],
)
def test_pool_constructor_validation(kwargs: dict[str, Any], error: type, match: str) -> None:
    args = {"processes": 1, **kwargs}
    with pytest.raises(error, match=match):
        Pool(**args)


def test_ctx_pool_context_count_must_match() -> None:
    with pytest.raises(ValueError, match="Context number is not equal to the number of pool workers"):
        CtxPool(2, worker_contexts=[1])
    with pytest.raises(ValueError, match="Context number is not equal"):
        pc_pool.CtxThreadPool(2, worker_contexts=[1, 2, 3])


def test_pool_call_validation(fork_pool: Pool) -> None:
    with pytest.raises(TypeError, match="func must be callable"):
        fork_pool.apply(3)
    with pytest.raises(ValueError, match="chunksize must be an int >= 1, got 0"):
        fork_pool.map(tu.ident, [1], chunksize=0)
    with pytest.raises(TypeError, match="kwds must be a dict"):
        fork_pool.apply(tu.ident, (1,), [("a", 1)])
    with pytest.raises(TypeError, match="callback must be callable"):
        fork_pool.apply_async(tu.ident, (1,), callback=5)


def test_pool_workers_ignore_sigint_and_have_parent_death_signal(fork_pool: Pool) -> None:
    handler = fork_pool.apply(lambda: signal.getsignal(signal.SIGINT))
    assert handler == signal.SIG_IGN
    assert os.getpid() != fork_pool.apply(tu.getpid)


def test_pool_is_recursive_carries_globals_defined_after_fork() -> None:
    plain = _fork(Pool, 1, share_method="cpu")
    recursive = _fork(Pool, 1, share_method="cpu", is_recursive=True)
    try:
        globals()["LATE_GLOBAL"] = 5  # created after both pools forked their workers
        func = eval("lambda x: x + LATE_GLOBAL", globals())
        with pytest.raises(NameError, match="LATE_GLOBAL"):
            plain.apply_async(func, (1,)).get(tu.T)
        assert recursive.apply_async(func, (1,)).get(tu.T) == 6
    finally:
        globals().pop("LATE_GLOBAL", None)
        plain.terminate()
        recursive.terminate()


def test_pool_calls_after_terminate_touch_no_foreign_fd() -> None:
    pool = _fork(Pool, 1, share_method="cpu")
    pool.terminate()
    pool.join(tu.T)
    r, w = os.pipe()  # likely reuses the numbers of the pool's closed wakeup pipe
    try:
        pool.close()
        pool.terminate()
        os.set_blocking(r, False)
        with pytest.raises(BlockingIOError):
            os.read(r, 1)  # nothing was written into our pipe
    finally:
        os.close(r)
        os.close(w)


def test_pool_is_freed_by_reference_counting_after_terminate() -> None:
    # The pool's parts hold the pool (its hooks) only in their threads' arguments, which end with the threads:
    # no reference cycle keeps a finished pool (and what it references) alive until a garbage collection.
    gc.disable()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*multi-threaded.*fork.*", category=DeprecationWarning)
            pool = pc_pool.Pool(2, share_method="cpu")
        assert pool.map(tu.ident, range(4)) == [0, 1, 2, 3]
        pool.terminate()
        ref = weakref.ref(pool)
        del pool
        assert ref() is None
    finally:
        gc.enable()
