"""The fault matrix: every call form x {task raises, unpicklable argument, unpicklable result, worker SIGKILL}
on Pool, P2PPool and CtxPool (fork) and Pool (spawn), then terminate/timeout on private pools.

After every row the same pool must still serve a new apply.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import multiprocessing.pool
import os
import pathlib
import pickle
import signal
import time
import warnings
from multiprocessing.connection import wait
from typing import Any

import pool_testutils as tu
import psutil
import pytest

import pc_pool
from pc_pool import PoolTerminatedError, RemoteTraceback, WorkerDiedError


def _assert_pool_serves(pool: Any) -> None:
    assert pool.apply_async(tu.ident, (41,)).get(tu.T) == 41
    assert pool.size() == 2


@pytest.mark.parametrize("form", tu.FORMS)
def test_pool_task_exception_reraises_with_remote_traceback(any_pool: Any, form: str) -> None:
    with pytest.raises(ValueError, match="boom 5") as info:
        tu.call(any_pool, form, tu.raise_value_error, 5)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert 'raise ValueError(f"boom {args[-1]}")' in cause.tb
    _assert_pool_serves(any_pool)


@pytest.mark.parametrize("form", tu.FORMS)
def test_pool_unpicklable_argument_fails_that_task(any_pool: Any, form: str) -> None:
    with pytest.raises(pickle.PicklingError, match="Unpicklable"):
        tu.call(any_pool, form, tu.ident, {"key": tu.Unpicklable()})
    _assert_pool_serves(any_pool)


@pytest.mark.parametrize("form", tu.FORMS)
def test_pool_unpicklable_result_is_maybe_encoding_error(any_pool: Any, form: str) -> None:
    with pytest.raises(multiprocessing.pool.MaybeEncodingError, match="Unpicklable"):
        tu.call(any_pool, form, tu.return_unpicklable, 1)
    _assert_pool_serves(any_pool)


def _check_sigkill(pool: Any, form: str) -> None:
    # Reported as WorkerDiedError, not as the call's timeout (multiprocessing.TimeoutError after tu.T): the
    # death itself ends the wait, no clock is needed to tell.
    with pytest.raises(WorkerDiedError) as info:
        tu.call(pool, form, tu.kill_self, 0)
    assert info.value.signal == "SIGKILL"
    assert info.value.exitcode is None
    assert info.value.pid is not None
    assert "SIGKILL" in str(info.value)
    _assert_pool_serves(pool)


@pytest.mark.parametrize("form", tu.FORMS)
@pytest.mark.parametrize("pool_name", ["fork_pool", "fork_p2p_pool", "fork_ctx_pool"])
def test_pool_worker_sigkill_fails_only_its_task(
    request: pytest.FixtureRequest, pool_name: str, form: str
) -> None:
    _check_sigkill(request.getfixturevalue(pool_name), form)


def test_pool_worker_sigkill_spawn(spawn_pool: Any) -> None:
    # A spawned replacement imports torch (seconds), so one call form covers the spawn path.
    _check_sigkill(spawn_pool, "apply_async")


def test_pool_sigkill_spares_other_tasks_of_the_same_map(fork_pool: Any) -> None:
    funcs_args = list(range(20))
    result = fork_pool.map_async(_kill_on_7, funcs_args, chunksize=1)
    with pytest.raises(WorkerDiedError):
        result.get(tu.T)
    it = fork_pool.imap(_kill_on_7, funcs_args)
    got = []
    for i in funcs_args:
        if i == 7:
            with pytest.raises(WorkerDiedError):
                it.next(timeout=tu.T)
        else:
            got.append(it.next(timeout=tu.T))
    assert got == [i for i in funcs_args if i != 7]
    _assert_pool_serves(fork_pool)


def _kill_on_7(x: int) -> int:
    if x == 7:
        tu.kill_self()
    return x


@pytest.mark.parametrize(
    ("func", "exitcode", "sig"),
    [(tu.exit_3, 3, None), (tu.sys_exit_3, 3, None), (tu.segfault, None, "SIGSEGV")],
    ids=["os._exit", "sys.exit", "segfault"],
)
def test_pool_worker_exit_or_crash_is_worker_died(fork_pool: Any, func: Any, exitcode: Any, sig: Any) -> None:
    with pytest.raises(WorkerDiedError) as info:
        fork_pool.apply_async(func, (0,)).get(tu.T)
    assert info.value.exitcode == exitcode
    assert info.value.signal == sig
    _assert_pool_serves(fork_pool)


def test_pool_idle_workers_killed_in_turn(fork_pool: Any) -> None:
    for _ in range(2):
        pid = next(w for w in fork_pool._workers if w is not None).process.pid
        os.kill(pid, signal.SIGKILL)  # no join: the pool reaps its own children
        assert fork_pool.map(tu.ident, range(8), chunksize=1) == list(range(8))
    _assert_pool_serves(fork_pool)


@pytest.mark.parametrize("where", ["worker", "parent"])
def test_pool_unpickling_failure_fails_that_task(fork_pool: Any, where: str) -> None:
    if where == "worker":
        result = fork_pool.apply_async(tu.ident, (tu.FailsToLoadInWorker(),))
    else:
        result = fork_pool.apply_async(tu.return_parent_unloadable, (0,))
    with pytest.raises(RuntimeError, match=f"refusing to load in the {where}"):
        result.get(tu.T)
    _assert_pool_serves(fork_pool)


def test_pool_unpicklable_exception_is_maybe_encoding_error(fork_pool: Any) -> None:
    with pytest.raises(multiprocessing.pool.MaybeEncodingError, match="cannot travel") as info:
        fork_pool.apply_async(tu.raise_unpicklable, (0,)).get(tu.T)
    assert isinstance(info.value.__cause__, RemoteTraceback)
    _assert_pool_serves(fork_pool)


def test_pool_callback_that_raises_does_not_break_delivery(fork_pool: Any, caplog: Any) -> None:
    def bad_callback(value: Any) -> None:
        raise RuntimeError("callback failed")

    assert fork_pool.apply_async(tu.ident, (3,), callback=bad_callback).get(tu.T) == 3
    with pytest.raises(ValueError, match="boom"):
        fork_pool.apply_async(tu.raise_value_error, (3,), error_callback=bad_callback).get(tu.T)
    assert "callback raised" in caplog.text
    _assert_pool_serves(fork_pool)


# ------------------------------------------------------------------------------------------------------------
# terminate and timeouts, on private pools
# ------------------------------------------------------------------------------------------------------------
def _new_pool(kind: str) -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*multi-threaded.*fork.*", category=DeprecationWarning)
        if kind == "Pool":
            return pc_pool.Pool(2, share_method="cpu")
        if kind == "P2PPool":
            return pc_pool.P2PPool(2, share_method="cpu")
        if kind == "CtxPool":
            return pc_pool.CtxPool(2, worker_contexts=[0, 1], share_method="cpu")
        return pc_pool.Pool(2)


@pytest.mark.parametrize("kind", ["Pool", "P2PPool", "CtxPool", "spawn"])
def test_pool_timeout_then_terminate_fails_every_form(kind: str) -> None:
    pool = _new_pool(kind)
    executor = concurrent.futures.ThreadPoolExecutor(3)
    try:
        items = list(range(20))
        asyncs = [
            pool.apply_async(tu.sleep_long, (0,)),
            pool.map_async(tu.sleep_long, items),
            pool.starmap_async(tu.sleep_long, [(i,) for i in items]),
        ]
        iters = [pool.imap(tu.sleep_long, items), pool.imap_unordered(tu.sleep_long, items)]
        syncs = [
            executor.submit(pool.apply, tu.sleep_long, (0,)),
            executor.submit(pool.map, tu.sleep_long, items),
            executor.submit(pool.starmap, tu.sleep_long, [(i,) for i in items]),
        ]
        for r in asyncs:
            with pytest.raises(multiprocessing.TimeoutError):
                r.get(0.05)
            assert not r.ready()
        for it in iters:
            with pytest.raises(multiprocessing.TimeoutError):
                it.next(timeout=0.05)
        pids = [w.process.pid for w in pool._workers if w is not None]
        pool.terminate()
        # terminate() is bounded: when it returns, its workers (running 30 s sleeps) are gone; and every
        # wait below ends with PoolTerminatedError, not with its own timeout or a task that finished.
        assert pids
        assert not [p for p in pids if _alive(p)], "terminate() returned with workers alive"
        for r in asyncs:
            with pytest.raises(PoolTerminatedError):
                r.get(tu.T)
            assert r.ready()
            assert not r.successful()
        for it in iters:
            with pytest.raises(PoolTerminatedError):
                it.next(timeout=tu.T)
        for fut in syncs:
            with pytest.raises(PoolTerminatedError):
                fut.result(tu.T)
        assert isinstance(PoolTerminatedError(), concurrent.futures.CancelledError)
        with pytest.raises(ValueError, match="Pool not running"):
            pool.apply_async(tu.ident, (1,))
        pool.join(tu.T)
    finally:
        pool.terminate()
        executor.shutdown(wait=True)


def _clean_up_slowly(started_fd: int, marker: str) -> None:
    try:
        os.write(started_fd, b"x")
        time.sleep(3600)
    finally:  # terminate() repeats SIGTERM meanwhile; none of the repeats may cut this short
        time.sleep(0.3)
        pathlib.Path(marker).write_text("unwound")


def test_pool_terminate_lets_a_worker_finish_unwinding(tmp_path: pathlib.Path) -> None:
    started_r, started_w = os.pipe()  # inherited by the fork worker
    marker = tmp_path / "marker"
    try:
        with pc_pool.Pool(1, share_method="cpu") as pool:
            result = pool.apply_async(_clean_up_slowly, (started_w, str(marker)))
            assert wait([started_r], tu.T), "the task did not start"
            pool.terminate()
            with pytest.raises(PoolTerminatedError):
                result.get(tu.T)
        assert marker.read_text() == "unwound"
    finally:
        os.close(started_r)
        os.close(started_w)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_pool_initializer_raises_breaks_pool_without_respawn_loop() -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*multi-threaded.*fork.*", category=DeprecationWarning)
        pool = pc_pool.Pool(2, initializer=tu.failing_initializer, share_method="cpu")
    try:
        result = pool.apply_async(tu.ident, (1,)) if pool._state is pc_pool.PoolStates.RUN else None
        if result is not None:
            with pytest.raises(PoolTerminatedError) as info:
                result.get(tu.T)
            assert isinstance(info.value.__cause__, OSError)
        pool.join(tu.T)
        with pytest.raises(ValueError, match="initializer failed on purpose"):
            pool.apply_async(tu.ident, (1,))
        assert pool._state is pc_pool.PoolStates.TERMINATE
    finally:
        pool.terminate()
