"""Ctrl-C, parent SIGKILL and interpreter exit, each in a script run in its own process group."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time
from multiprocessing.connection import wait

import psutil
import pytest

TESTS_DIR = pathlib.Path(__file__).resolve().parent

SCRIPT = r"""
import faulthandler, os, signal, sys
import pool_testutils as tu
from pc_pool import Pool

if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test dumps our stacks if we hang
    mode, fd = sys.argv[1], int(sys.argv[2])
    pool = Pool(2, share_method="cpu")
    result = pool.map_async(tu.sleep_long, range(4), chunksize=1)
    pids = [w.process.pid for w in pool._workers]
    os.write(fd, (" ".join(map(str, pids)) + "\n").encode())
    os.close(fd)
    if mode == "parent-kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "exit":
        sys.exit(0)  # no close/terminate: the atexit finalizer must stop the workers
    elif mode == "ctrl-c-join":
        pool.close()
        pool.join()  # no timeout: the pending tasks keep it waiting until Ctrl-C arrives here
    result.get(3600)  # Ctrl-C arrives here; the test gives up long before this timeout could end it
"""


def _preexec() -> None:
    os.setpgrp()
    # Without this, a runner that inherited SIG_IGN for SIGINT would pass the Ctrl-C test vacuously.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run(tmp_path: pathlib.Path, mode: str) -> tuple[subprocess.Popen[bytes], list[int], pathlib.Path]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    err = tmp_path / "stderr.txt"
    r, w = os.pipe()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    with open(tmp_path / "stdout.txt", "wb") as out, open(err, "wb") as errf:
        proc = subprocess.Popen(
            [sys.executable, str(script), mode, str(w)],
            stdout=out,
            stderr=errf,
            pass_fds=(w,),
            preexec_fn=_preexec,
            env=env,
        )
    os.close(w)
    try:
        assert wait([r], 120), "the script did not report its workers"
        line = os.read(r, 4096).decode()
    finally:
        os.close(r)
    assert line.strip(), err.read_text()
    return proc, [int(p) for p in line.split()], err


def _assert_gone(pids: list[int], within: float) -> None:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    deadline = time.monotonic() + within
    alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    while alive and time.monotonic() < deadline:
        _, alive = psutil.wait_procs(alive, timeout=0.2)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"orphaned workers: {[p.pid for p in alive]}"


def _cleanup(proc: subprocess.Popen[bytes], pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)


@pytest.mark.parametrize("mode", ["ctrl-c", "ctrl-c-join"])
def test_pool_ctrl_c_terminates_workers_and_exits_once(tmp_path: pathlib.Path, mode: str) -> None:
    proc, pids, err = _run(tmp_path, mode)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGUSR1)  # faulthandler writes every thread's stack to stderr
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(3)
            pytest.fail(f"the script did not exit within 30 s of Ctrl-C; its stderr:\n{err.read_text()}")
        text = err.read_text()
        assert proc.returncode != 0
        assert text.count("Traceback (most recent call last)") == 1, text
        assert "KeyboardInterrupt" in text
        # The wait ended by the interrupt itself (the script's own waits are an hour or unbounded, so only
        # the Ctrl-C could end them before proc.wait above gave up), not by a timeout.
        assert "TimeoutError" not in text, text
        _assert_gone(pids, 5)
    finally:
        _cleanup(proc, pids)


LATE_SIGNAL_SCRIPT = r"""
import multiprocessing, os, signal, sys, threading, time
import pool_testutils as tu
from pc_pool import Pool, SimpleP2PQueue, ThreadPool

# The innermost Python frame of each wait once it blocks in C (Condition.wait, Thread.join, selectors).
BLOCKING_FRAMES = {"wait", "join", "_wait_for_tstate_lock", "select"}


def main_thread_blocked() -> bool:
    main = threading.main_thread()
    frame = sys._current_frames().get(main.ident)
    if frame is None or frame.f_code.co_name not in BLOCKING_FRAMES:
        return False
    with open(f"/proc/self/task/{main.native_id}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "S"


def interrupt_when_blocked() -> None:
    # The Ctrl-C's handler runs in this thread once the main thread sleeps in the kernel: the lost wake-up
    # of a Ctrl-C that lands just before the wait blocks, or in a thread that does not block SIGINT.
    deadline = time.monotonic() + 60
    while not main_thread_blocked():
        if time.monotonic() > deadline:
            os._exit(3)
        time.sleep(0.002)
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)


if __name__ == "__main__":
    mode = sys.argv[1]
    pool = ThreadPool(2) if mode.startswith("thread") else Pool(2, share_method="cpu")
    queue = SimpleP2PQueue()
    wait = {
        "get": lambda: pool.apply_async(tu.sleep_hour).get(3600),
        "thread-get": lambda: pool.apply_async(tu.sleep_hour).get(3600),
        "imap": lambda: next(pool.imap(tu.sleep_hour, range(2))),
        "join": lambda: (pool.apply_async(tu.sleep_hour), pool.close(), pool.join()),
        "thread-join": lambda: (pool.apply_async(tu.sleep_hour), pool.close(), pool.join()),
        "queue-get": lambda: queue.get(),
    }[mode]
    threading.Thread(target=interrupt_when_blocked, daemon=True).start()
    try:
        wait()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        if mode == "join":  # the Ctrl-C terminated the pool, whose workers are reaped before it propagates
            print("children", len(multiprocessing.active_children()), flush=True)
        if mode == "thread-join":  # terminate() lets the running call finish: join still waits for it
            try:
                pool.join(0.2)
                print("joined a running thread", flush=True)
            except TimeoutError:
                print("still running", flush=True)
        raise
"""


@pytest.mark.parametrize("mode", ["get", "thread-get", "imap", "join", "thread-join", "queue-get"])
def test_pool_main_thread_waits_see_a_ctrl_c_handled_elsewhere(tmp_path: pathlib.Path, mode: str) -> None:
    # A kernel wait of the main thread is not woken by a Ctrl-C whose handler ran elsewhere: without the
    # sliced waits of the main thread this script waits out its hour-long (or unbounded) wait.
    script = tmp_path / "late_signal.py"
    script.write_text(LATE_SIGNAL_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, str(script), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_preexec,
        env=env,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        pytest.fail(f"{mode}: the main thread's wait did not end within 60 s of the Ctrl-C")
    assert proc.returncode != 3, f"{mode}: the main thread never blocked"
    # join: a Ctrl-C that interrupts Thread.join on CPython 3.10-3.12 marks the live thread stopped
    # (gh-90882), so a pool that waited in Thread.join would stop waiting for its workers' reaping.
    after = {"join": ["children 0"], "thread-join": ["still running"]}.get(mode, [])
    assert out.split("\n")[:-1] == ["interrupted", *after], err
    assert err.count("Traceback (most recent call last)") == 1, err
    assert "KeyboardInterrupt" in err


def test_pool_parent_sigkill_leaves_no_orphans(tmp_path: pathlib.Path) -> None:
    proc, pids, _ = _run(tmp_path, "parent-kill")
    try:
        proc.wait(30)
        assert proc.returncode == -signal.SIGKILL
        _assert_gone(pids, 5)
    finally:
        _cleanup(proc, pids)


@pytest.mark.parametrize("mode", ["exit"])
def test_pool_interpreter_exit_stops_live_pools(tmp_path: pathlib.Path, mode: str) -> None:
    proc, pids, err = _run(tmp_path, mode)
    try:
        proc.wait(30)
        assert proc.returncode == 0, err.read_text()
        _assert_gone(pids, 5)
    finally:
        _cleanup(proc, pids)


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="no per-thread signal masks here")
def test_pool_threads_block_sigint_from_their_first_instruction(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every pool-owned thread has SIGINT blocked before it runs any code, and the caller's mask is untouched.

    A thread that blocked SIGINT only once it ran left a window (a loaded machine leaves it open for a while)
    in which a Ctrl-C landed in it and the main thread's ``get()`` never saw it.
    """
    import threading

    from pc_pool import Pool

    masks: dict[str, set[int]] = {}
    original_run = threading.Thread.run

    def recording_run(self: threading.Thread) -> None:
        if self.name.startswith("pc_pool-"):
            masks[self.name] = set(signal.pthread_sigmask(signal.SIG_BLOCK, []))
        original_run(self)

    monkeypatch.setattr(threading.Thread, "run", recording_run)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    with Pool(2, share_method="cpu") as pool:
        assert list(pool.imap(abs, iter([-1, -2, -3]), chunksize=1)) == [1, 2, 3]
        assert set(signal.pthread_sigmask(signal.SIG_BLOCK, [])) == set(before)
    expected = {"pc_pool-results", "pc_pool-feeder-0", "pc_pool-feeder-1", "pc_pool-imap-input"}
    assert expected <= set(masks), masks
    unblocked = [name for name, mask in masks.items() if signal.SIGINT not in mask]
    assert not unblocked, f"threads that started with SIGINT deliverable: {unblocked}"
