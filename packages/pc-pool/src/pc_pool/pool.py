"""The process pool engine, :class:`BasePool`: per-worker pipes, one feeder per worker, one result thread.

::

  caller threads           parent process                                      worker process i
  apply/map/imap --> job table + ready deque --> feeder i --dumps--> task pipe i --> loads (func cached/job)
                                                                                     | run
  AsyncResult <-- set + callbacks <-- result thread <------------ result pipe i <-- dumps
                                      wait(result pipes, sentinels, wakeup)
                                      sentinel i fires -> fail its in-flight chunk, respawn i

**Callers** validate, cut the iterable into chunks and append them to the ready deque (``P2PPool``: to the
deque of the chunk's worker). They never touch a pipe and never block except in ``get``/``next``/``wait``.

**Feeder i** owns the write end of task pipe i. It keeps at most 2 chunks outstanding on worker i (4 while
its answers come back within 2 ms), serializes each chunk when it dispatches it (so memory stays bounded and
``terminate`` leaves few unsent share handles) and is the only thread that writes to that pipe, so a full
pipe stalls worker i only. A pickling error fails that chunk alone.

**The result thread** owns the read ends of all result pipes and starts every worker (so ``PR_SET_PDEATHSIG``,
which follows the forking *thread*, fires only when the pool is gone). It blocks in
``multiprocessing.connection.wait`` on the result pipes, the worker sentinels and a wakeup pipe; nothing
polls. When a sentinel fires it drains that worker's pipe, fails the first unanswered chunk (the one that was
running) with :class:`~pc_pool.WorkerDiedError`, puts the rest back, and starts a replacement at the same
index.

Sending and receiving live in different threads, so a large task never deadlocks against a worker that is
itself blocked writing a large result. Every wait has a timeout; ``terminate()`` is bounded (SIGTERM, then
SIGKILL after ``KILL_GRACE`` seconds).
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import multiprocessing.context
import os
import threading
from collections.abc import Callable, Iterable
from multiprocessing.connection import wait
from typing import Any

from pc_pool._api import PoolFrontend
from pc_pool._collector import CollectorMixin
from pc_pool._engine import KILL_GRACE, TICK, PoolStates, check_pool_args, now, register_pool, unregister_pool
from pc_pool._feeder import FeederMixin
from pc_pool._protocol import recv_msg, send_msg
from pc_pool._records import Chunk, Job, WorkerHandle
from pc_pool.errors import PoolTerminatedError
from pc_pool.worker import worker_loop

__all__ = ["BasePool", "PoolStates"]


class BasePool(FeederMixin, CollectorMixin, PoolFrontend):
    """The basic process pool: stdlib ``multiprocessing.Pool`` semantics that never hang.

    Workers are started with ``context`` (default: spawn, never the interpreter default). A worker that dies
    fails exactly the chunk it was running with :class:`~pc_pool.WorkerDiedError` and is replaced; a
    ``maxtasksperchild`` retirement is not a crash; ``terminate()`` fails everything pending with
    :class:`~pc_pool.PoolTerminatedError`. Functions and arguments travel through pc_pickle, so lambdas and
    closures work; tensors are copied.

    Args:
        processes: Number of worker processes (default ``os.cpu_count()``).
        initializer: Called as ``initializer(*initargs)`` in each worker before its first task. If it raises,
            the pool moves to TERMINATE and every call fails with that cause (no respawn loop).
        initargs: Arguments of ``initializer``.
        maxtasksperchild: Tasks (chunks) a worker runs before it is replaced; ``None`` means never.
        context: A ``multiprocessing`` context; ``None`` means ``get_context("spawn")``.

    Raises:
        ValueError: ``processes < 1`` or ``maxtasksperchild < 1``.
        TypeError: ``initializer`` is not callable, or a count is not an int.

    Examples:
        >>> with BasePool(2) as pool:  # doctest: +SKIP
        ...     pool.map(lambda x: x * 2, range(4))
        [0, 2, 4, 6]
    """

    _copy_tensor: bool = True
    _recurse: bool = False
    _daemon: bool = True
    _p2p: bool = False

    def __init__(
        self,
        processes: int | None = None,
        initializer: Callable[..., object] | None = None,
        initargs: Iterable[Any] = (),
        maxtasksperchild: int | None = None,
        context: multiprocessing.context.BaseContext | None = None,
    ) -> None:
        processes = check_pool_args(processes, initializer)
        if maxtasksperchild is not None:
            if isinstance(maxtasksperchild, bool) or not isinstance(maxtasksperchild, int):
                raise TypeError(
                    f"maxtasksperchild must be an int or None, got {type(maxtasksperchild).__name__}"
                )
            if maxtasksperchild < 1:
                raise ValueError(f"maxtasksperchild must be None or >= 1, got {maxtasksperchild}")
        self._processes = processes
        self._initializer = initializer
        self._initargs = tuple(initargs)
        self._maxtasksperchild = maxtasksperchild
        self._ctx = context if context is not None else multiprocessing.get_context("spawn")
        self._state = PoolStates.RUN
        self._cond = threading.Condition(threading.Lock())
        self._cache: dict[int, Any] = {}
        self._jobs: dict[int, Job] = {}
        self._workers: list[WorkerHandle | None] = [None] * processes
        self._stopping = False
        self._broken: BaseException | None = None
        self._chunk_counter = 0
        self._close_deadline: float | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._terminate_lock = threading.Lock()
        self.setup_queues()
        self._init_feeder()
        self._result_thread = threading.Thread(target=self._result_loop, name="pc_pool-results", daemon=True)
        self._feeders = [
            threading.Thread(target=self._feed, args=(i,), name=f"pc_pool-feeder-{i}", daemon=True)
            for i in range(processes)
        ]
        self._result_thread.start()
        if not self._started.wait(60.0) or self._start_error is not None:
            error = self._start_error or TimeoutError("pool workers did not start within 60 s")
            self.terminate()
            raise error
        for feeder in self._feeders:
            feeder.start()
        register_pool(self)

    # ========================================================================================================
    # Overridable hooks (the seed's contracts, adapted to one pipe pair per worker)
    # ========================================================================================================
    def setup_queues(self) -> None:
        """Create the parent-side queues: the ready deques and the result thread's wakeup pipe.

        The task and result pipes themselves are created per worker by :meth:`repopulate_pool`.
        """
        self._ready: collections.deque[Chunk] = collections.deque()
        self._slot_ready: list[collections.deque[Chunk]] = [
            collections.deque() for _ in range(self._processes)
        ]
        self._wake_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)

    def pool_inqueue_put(self, obj: Any) -> int:
        """Send one task message ``obj = (worker_index, header, payload)`` to that worker's task pipe.

        Called by the worker's feeder thread, the only writer of that pipe.

        Returns:
            The number of bytes written (used to tell, after a death, which chunks the worker never read).
        """
        index, header, payload = obj
        handle = self._workers[index]
        if handle is None:
            raise OSError(f"worker {index} is gone")
        return send_msg(handle.task_conn, header, payload)

    def pool_outqueue_get(self, timeout: float) -> list[tuple[int, Any]]:
        """Wait up to ``timeout`` seconds for worker events; return them as ``(worker_index, event)`` pairs.

        An event is a received message ``(header, payload)``, or ``None`` when the worker's process ended.

        Raises:
            TimeoutError: Nothing happened within ``timeout``.
            OSError: The pool is shutting down.
        """
        if self._stopping:
            raise OSError("pool is shutting down")
        handles = [w for w in self._workers if w is not None and not w.dead]
        by_conn = {w.result_conn: w for w in handles}
        by_sentinel = {w.process.sentinel: w for w in handles}
        ready = wait([*by_conn, *by_sentinel, self._wake_r], timeout)
        if not ready:
            raise TimeoutError(f"no worker event within {timeout} s")
        if self._wake_r in ready:
            self._drain_wakeups()
        events: list[tuple[int, Any]] = []
        dead: list[WorkerHandle] = []
        for obj in ready:
            if obj in by_conn:
                w = by_conn[obj]
                try:
                    for _ in range(256):  # bounded, so one chatty worker cannot starve the others
                        events.append((w.index, recv_msg(w.result_conn)))
                        if not w.result_conn.poll(0):
                            break
                except (EOFError, OSError):
                    dead.append(w)
            elif obj in by_sentinel:
                dead.append(by_sentinel[obj])
        events.extend((w.index, None) for w in dict.fromkeys(dead))
        return events

    @staticmethod
    def worker(
        get: Callable[[], Any],
        put: Callable[[Any], None],
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
        maxtasks: int | None = None,
    ) -> None:
        """The default worker function executed by worker processes.

        Override this method to implement your own pool.

        Args:
            get: A function of form ``get() -> task | None`` used to get tasks (``None``: exit).
            put: A function of form ``put(reply)`` used to put results; ``task()`` returns the reply.
            initializer: An initializer function to init global environment in worker processes.
            initargs: Initializer arguments.
            maxtasks: Maximum number of tasks a worker runs before it retires (and is replaced).
        """
        worker_loop(get, put, initializer, initargs, maxtasks)

    def repopulate_pool(self) -> None:
        """Bring the number of workers up to ``processes``, starting each missing index.

        Called by the result thread only (the thread that must fork every worker). Starting workers stops once
        the pool terminates, or when it is closed with nothing left to do.
        """
        for index in range(self._processes):
            if self._workers[index] is None and self._wants_workers():
                w = self._start_worker(index)
                with self._cond:
                    self._workers[index] = w
                    # Wake the feeders now: a P2PPool's chunks pinned to this index wait for this worker, and
                    # its feeder would otherwise notice it only at its next periodic check (TICK, 5 s).
                    self._cond.notify_all()

    def maintain_pool(self) -> None:
        """Reap workers whose process ended (crash or retirement) and start replacements."""
        for w in list(self._workers):
            if w is not None and not w.dead and w.process.exitcode is not None:
                self._reap(w)
        self.repopulate_pool()

    def join_workers(self) -> None:
        """Wait until all workers have exited (each is given ``KILL_GRACE`` seconds, then killed)."""
        for w in self._workers:
            if w is not None:
                w.process.join(KILL_GRACE)
                if w.process.exitcode is None:
                    w.process.kill()
                    w.process.join(TICK)

    def terminate_workers(self) -> None:
        """Force terminate all workers: SIGTERM, then SIGKILL after ``KILL_GRACE`` seconds."""
        live = [w for w in self._workers if w is not None and w.process.exitcode is None]
        for w in live:
            with contextlib.suppress(OSError, ValueError):  # already gone
                w.process.terminate()
        pending = {w.process.sentinel: w for w in live}
        deadline = now() + KILL_GRACE
        while pending and (left := deadline - now()) > 0:
            for sentinel in wait(list(pending), left):
                pending.pop(sentinel)  # type: ignore[arg-type]
        for w in pending.values():
            w.process.kill()

    # ========================================================================================================
    # Lifecycle
    # ========================================================================================================
    def _check_running(self) -> None:
        if self._state is not PoolStates.RUN:
            if self._broken is not None:
                raise ValueError(f"Pool not running: it broke because {self._broken!r}") from self._broken
            raise ValueError("Pool not running")

    def close(self) -> None:
        """Stop accepting work; pending work drains, then the workers exit. Call :meth:`join` to wait."""
        with self._cond:
            if self._state is PoolStates.RUN:
                self._state = PoolStates.CLOSE
            self._cond.notify_all()
        self._wake()

    def terminate(self) -> None:
        """Fail all pending results with :class:`~pc_pool.PoolTerminatedError`; stop the workers (bounded)."""
        with self._terminate_lock:
            self._fail_everything(PoolTerminatedError("the pool was terminated before this result arrived"))
            self._wake()
            if (
                threading.current_thread() is not self._result_thread
                and self._result_thread.ident is not None
            ):
                self._result_thread.join(TICK + 2 * KILL_GRACE)
            self._join_feeders()
            unregister_pool(self)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the workers and the pool's threads to exit after :meth:`close` or :meth:`terminate`.

        Args:
            timeout: Seconds to wait at most; ``None`` waits until pending work has drained.

        Raises:
            ValueError: The pool is still running (call ``close()`` or ``terminate()`` first).
            TimeoutError: The pool did not shut down within ``timeout``.
        """
        if self._state is PoolStates.RUN:
            raise ValueError("Pool is still running; call close() or terminate() before join()")
        deadline = None if timeout is None else now() + timeout
        try:
            while self._result_thread.is_alive():
                left = TICK if deadline is None else min(TICK, deadline - now())
                if left <= 0:
                    raise TimeoutError(f"pool did not shut down within {timeout} s")
                self._result_thread.join(left)
        except KeyboardInterrupt:
            self._handle_interrupt()
            raise
        self._join_feeders()
        unregister_pool(self)

    def __enter__(self) -> BasePool:
        self._check_running()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.terminate()

    def _handle_interrupt(self) -> None:
        """Ctrl-C while a caller waits on this pool: terminate it (the KeyboardInterrupt propagates)."""
        self.terminate()

    def _join_feeders(self) -> None:
        with self._cond:
            self._cond.notify_all()
        for feeder in self._feeders:
            if feeder.ident is not None and feeder is not threading.current_thread():
                feeder.join(TICK)

    # ========================================================================================================
    # Submission (caller threads)
    # ========================================================================================================
    def _submit(self, func: Callable[..., Any], mode: int, chunks: list[list[Any]], result: Any) -> None:
        job = Job(result._job, func, mode, result)
        result._owner = self
        with self._cond:
            self._check_running()
            self._jobs[job.id] = job
            for index, items in enumerate(chunks):
                slot = None
                if self._p2p:
                    slot = self._chunk_counter % self._processes
                    self._chunk_counter += 1
                    self._slot_ready[slot].append(Chunk(job, index, items, slot))
                else:
                    self._ready.append(Chunk(job, index, items))
            self._cond.notify_all()
