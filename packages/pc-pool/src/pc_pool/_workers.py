"""The worker processes of a process pool: starting them, their pipes, waiting on them, stopping them.

:class:`WorkerSet` holds what starting a worker needs (the context, the worker hook, the initializer, the
tensor mode) and a reference to the :class:`~pc_pool._state.EngineState` whose ``workers`` list it fills. It
implements the default behaviour of the pool's hooks ``pool_inqueue_put`` (:meth:`send`),
``pool_outqueue_get`` (:meth:`wait_events`), ``repopulate_pool`` (:meth:`repopulate`), ``terminate_workers``
and ``join_workers``; :class:`~pc_pool.BasePool` delegates those hooks here.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing.context
import os
import select
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from typing import Any

from pc_pool import _serial
from pc_pool._protocol import frame_msg, send_msg, write_all
from pc_pool._quiet import quiet_numpy_warning_in_children
from pc_pool._reader import ResultReader
from pc_pool._records import WorkerHandle
from pc_pool._settings import KILL_GRACE, NO_CONTEXT, TERM_REPEAT, TICK, now
from pc_pool._state import EngineState
from pc_pool.worker import worker_main

__all__ = ["WorkerSet"]


_log = logging.getLogger(__name__)
_MAX_BURST = 256  # messages read from one worker per wake-up, so a chatty worker cannot starve the others
_fork_lock = threading.Lock()  # one freeze, fork and unfreeze at a time, whichever pool forks


def _new_fork_lock() -> None:
    # A worker is forked while its pool holds the lock: a pool made inside a task needs a free one.
    global _fork_lock
    _fork_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_fork_lock)


@contextlib.contextmanager
def _inherited_objects_frozen(fork: bool) -> Iterator[None]:
    """Fork with the parent's objects in the collector's permanent generation: the worker never collects them.

    Garbage in a reference cycle that the parent has not collected yet would otherwise be collected in the
    forked worker, where the parent's other threads do not exist: a torch gloo process group's destructor
    waits there for worker threads of its own and hangs the worker. A worker's collections never examine
    frozen objects, and the parent unfreezes them as soon as the fork returns (its own collector then deals
    with them, where their threads live). Freezing moves whole generations at once: no traversal of the
    heap, unlike a full collection before every fork. A program that froze objects itself (``gc.freeze()``
    before forking, as Python's docs advise) would see that undone by the unfreeze: then the parent collects
    its garbage before the fork instead.
    """
    if not fork:
        yield
        return
    with _fork_lock:
        if gc.get_freeze_count():
            gc.collect()
            yield
            return
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()


class WorkerSet:
    """Starts, watches and stops the worker processes of one pool.

    Args:
        state: The pool's engine state (its ``workers`` list holds the handles).
        ctx: The ``multiprocessing`` context workers are started with.
        worker_fn: The pool's ``worker`` hook, run in each worker.
        initializer: Called with ``initargs`` in each worker before its first task.
        initargs: Arguments of ``initializer``.
        maxtasks: ``maxtasksperchild``.
        copy_tensor: Copy tensors (``False``: share them; result pipes are then duplex for the acks).
        recurse: Carry the globals of by-value functions by value.
        daemon: Start workers as daemon processes.
    """

    def __init__(
        self,
        state: EngineState,
        ctx: multiprocessing.context.BaseContext,
        worker_fn: Callable[..., None],
        *,
        initializer: Callable[..., object] | None,
        initargs: tuple[Any, ...],
        maxtasks: int | None,
        copy_tensor: bool,
        recurse: bool,
        daemon: bool,
    ) -> None:
        self._state = state
        self._ctx = ctx
        self._worker_fn = worker_fn
        self._initializer = initializer
        self._initargs = initargs
        self._maxtasks = maxtasks
        self._copy_tensor = copy_tensor
        self._recurse = recurse
        self._daemon = daemon
        self._forks = ctx.get_start_method() == "fork"
        self._poller = select.poll()
        self._by_fd: dict[int, tuple[WorkerHandle, bool]] = {}
        self._poll_key: tuple[Any, ...] | None = None

    # -- starting --------------------------------------------------------------------------------------------
    def start(self, index: int, context_of: Callable[[int], Any]) -> WorkerHandle:
        """Start worker ``index`` with a fresh task pipe and result pipe; return its handle.

        ``context_of(index)`` is the worker's context (``CtxPool``) or ``NO_CONTEXT`` (passed per call, not
        stored: the pool's bound method would make a reference cycle).
        """
        task_r, task_w = self._ctx.Pipe(duplex=False)
        # Share mode: a Unix socket pair (duplex), so a result's fds can travel with it (SCM_RIGHTS).
        result_r, result_w = self._ctx.Pipe(duplex=not self._copy_tensor)
        try:
            context = context_of(index)
            has_ctx = context is not NO_CONTEXT
            init_blob = _serial.dumps(
                (self._initializer, self._initargs, has_ctx, context if has_ctx else None),
                recurse=self._recurse,
                copy_tensor=self._copy_tensor,
            )
            process = self._ctx.Process(  # type: ignore[attr-defined]
                target=worker_main,
                args=(
                    self._worker_fn,
                    task_r,
                    result_w,
                    init_blob,
                    self._copy_tensor,
                    self._maxtasks,
                    os.getpid(),
                ),
                name=f"pc_pool-worker-{index}",
                daemon=self._daemon,
            )
            with quiet_numpy_warning_in_children(), _inherited_objects_frozen(self._forks):
                process.start()
        except BaseException:
            for conn in (task_r, task_w, result_r, result_w):
                conn.close()
            raise
        task_r.close()
        result_w.close()
        return WorkerHandle(index, process, task_w, result_r, ResultReader(result_r, bulk=self._copy_tensor))

    def repopulate(self, context_of: Callable[[int], Any]) -> None:
        """Start every missing worker index while the pool wants workers (result thread only)."""
        st = self._state
        for index in range(st.processes):
            if st.workers[index] is None and st.wants_workers():
                w = self.start(index, context_of)
                with st.cond:
                    st.workers[index] = w
                    # Wake the feeders now: a P2PPool's chunks pinned to this index wait for this worker, and
                    # its feeder would otherwise notice it only at its next periodic check (TICK).
                    st.cond.notify_all()

    # -- pipes -----------------------------------------------------------------------------------------------
    def send(self, obj: tuple[int, tuple[Any, ...], bytes]) -> int:
        """Send ``(worker_index, header, payload)`` to that worker's task pipe; return the bytes written.

        Raises:
            OSError: The worker is gone.
        """
        index, header, payload = obj
        handle = self._state.workers[index]
        if handle is None:
            raise OSError(f"worker {index} is gone")
        return send_msg(handle.task_conn, header, payload)

    def send_batch(self, index: int, messages: list[tuple[tuple[Any, ...], bytes]]) -> list[int]:
        """Send several ``(header, payload)`` messages to worker ``index`` in one write; return their sizes.

        The worker reads them one by one exactly as if :meth:`send` had sent each. If the worker dies during
        the write, only the messages that went out whole are counted (a prefix of ``messages``).

        Raises:
            OSError: The worker is gone (nothing was sent).
        """
        handle = self._state.workers[index]
        if handle is None:
            raise OSError(f"worker {index} is gone")
        parts: list[bytes] = []
        sizes: list[int] = []
        for header, payload in messages:
            framed = frame_msg(header, payload)
            parts.extend(framed)
            sizes.append(sum(len(p) for p in framed))
        written, error = write_all(handle.task_conn.fileno(), parts)
        if error is None:
            return sizes
        whole: list[int] = []
        for size in sizes:
            if written < size:
                break
            written -= size
            whole.append(size)
        return whole

    def wait_events(self, timeout: float) -> list[tuple[int, Any]]:
        """Wait up to ``timeout`` s for worker events: ``(index, (header, payload))``, or ``(index, None)``.

        ``None`` means the worker's process ended (its sentinel fired, or its pipe broke).

        Raises:
            TimeoutError: Nothing happened within ``timeout``.
            OSError: The pool is shutting down.
        """
        st = self._state
        if st.stopping:
            raise OSError("pool is shutting down")
        poller = self._poller_for([w for w in st.workers if w is not None and not w.dead], st.wakeup.fileno)
        ready = poller.poll(max(0, int(timeout * 1000)))
        if not ready:
            raise TimeoutError(f"no worker event within {timeout} s")
        events: list[tuple[int, Any]] = []
        dead: list[WorkerHandle] = []
        for fd, _ in ready:
            what = self._by_fd.get(fd)
            if what is None:  # the wakeup pipe
                st.wakeup.drain()
                continue
            w, is_conn = what
            if not is_conn:
                dead.append(w)
                continue
            msgs: list[Any] = []
            try:
                w.reader.drain(_MAX_BURST, msgs)
            except (EOFError, OSError):
                dead.append(w)
            events.extend((w.index, msg) for msg in msgs)
        events.extend((w.index, None) for w in dict.fromkeys(dead))
        return events

    def _poller_for(self, handles: list[WorkerHandle], wake_fd: int) -> select.poll:
        """The ``poll`` object over the result pipes, the sentinels and ``wake_fd``; rebuilt when they change.

        ``multiprocessing.connection.wait`` builds a selector per call (~10 us); reusing one ``poll`` object
        makes a wake-up one system call. The handles are kept, so their ids cannot be reused meanwhile.
        """
        key = (wake_fd, *handles)
        old = self._poll_key
        if old is not None and len(key) == len(old) and all(a is b for a, b in zip(key, old, strict=True)):
            return self._poller
        poller = select.poll()
        by_fd: dict[int, tuple[WorkerHandle, bool]] = {}
        for w in handles:
            by_fd[w.result_conn.fileno()] = (w, True)
            by_fd[w.process.sentinel] = (w, False)
        for fd in (*by_fd, wake_fd):
            poller.register(fd, select.POLLIN)
        self._poller, self._by_fd, self._poll_key = poller, by_fd, key
        return poller

    # -- stopping --------------------------------------------------------------------------------------------
    def close(self, w: WorkerHandle) -> None:
        """Mark ``w`` dead and close its pipes and process object (after it exited)."""
        w.dead = True
        if w.send_lock.acquire(timeout=TICK):
            try:
                w.task_conn.close()
            finally:
                w.send_lock.release()
        w.result_conn.close()
        try:
            w.process.close()
        except ValueError:  # pragma: no cover - still running after kill + join
            _log.warning("pool worker pid %s did not exit", w.process.pid)

    def terminate_all(self) -> None:
        """SIGTERM every live worker, then SIGKILL those still alive after ``KILL_GRACE`` seconds.

        SIGTERM is repeated every ``TERM_REPEAT`` seconds until a worker exits: one that took the first
        signal just before a blocking call has not run its handler yet (see ``TERM_REPEAT``), and being
        killed instead of unwinding would leave the shared segments it holds behind.
        """
        live = [w for w in self._state.workers if w is not None and w.process.exitcode is None]
        pending = {w.process.sentinel: w for w in live}
        deadline = now() + KILL_GRACE
        while pending and (left := deadline - now()) > 0:
            for w in pending.values():
                with contextlib.suppress(OSError, ValueError):  # already gone
                    w.process.terminate()
            for sentinel in wait(list(pending), min(left, TERM_REPEAT)):
                pending.pop(sentinel)  # type: ignore[arg-type]
        for w in pending.values():
            w.process.kill()
        _serial.collect_cuda_ipc()

    def join_all(self) -> None:
        """Wait for every worker to exit (``KILL_GRACE`` seconds each, then SIGKILL)."""
        for w in self._state.workers:
            if w is not None:
                w.process.join(KILL_GRACE)
                if w.process.exitcode is None:
                    w.process.kill()
                    w.process.join(TICK)
        _serial.collect_cuda_ipc()
