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

**Feeder i** owns the write end of task pipe i. It keeps at most 2 chunks outstanding on worker i (while it
answers fast, about ``FAST_RTT`` seconds of its work, up to 32, written a half window per ``writev``),
serializes each chunk when it dispatches it (so memory stays bounded and ``terminate`` leaves few unsent share
handles) and is the only thread that writes to that pipe, so a full pipe stalls worker i only. A pickling
error fails that chunk alone.

**The result thread** owns the read ends of all result pipes and starts every worker (so ``PR_SET_PDEATHSIG``,
which follows the forking *thread*, fires only when the pool is gone). It blocks in
one reused ``poll`` object on the result pipes, the worker sentinels and a wakeup pipe; nothing
polls. When a sentinel fires it drains that worker's pipe, fails the first unanswered chunk (the one that was
running) with :class:`~pc_pool.WorkerDiedError`, puts the rest back, and starts a replacement at the same
index.

**Objects** (composition, no mixins): :class:`~pc_pool._state.EngineState` (jobs, ready deques, worker
handles, lifecycle; one condition guards it) is shared by reference; :class:`~pc_pool._feeder.Feeder` (the
feeder threads), :class:`~pc_pool._collector.ResultThread` (the result thread) and
:class:`~pc_pool._workers.WorkerSet` (process start/stop, pipes) each hold the references they need.
:class:`BasePool` wires them together; its seed hooks (``setup_queues``, ``pool_inqueue_put``,
``pool_outqueue_get``, ``repopulate_pool``, ``maintain_pool``, ``terminate_workers``, ``join_workers``,
``worker``) are thin delegates that a subclass may override.

Sending and receiving live in different threads, so a large task never deadlocks against a worker that is
itself blocked writing a large result. Every wait has a timeout; ``terminate()`` is bounded (SIGTERM, then
SIGKILL after ``KILL_GRACE`` seconds).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import threading
from collections.abc import Callable, Iterable
from typing import Any

from pc_pool._api import PoolFrontend
from pc_pool._checks import optional_positive_int
from pc_pool._collector import ResultThread
from pc_pool._feeder import Feeder
from pc_pool._live_pools import register_pool, unregister_pool
from pc_pool._records import Job, WorkerHandle
from pc_pool._settings import KILL_GRACE, NO_CONTEXT, TICK, PoolStates, check_pool_args
from pc_pool._signals import wait_in_slices
from pc_pool._state import EngineState
from pc_pool._workers import WorkerSet
from pc_pool.errors import PoolTerminatedError
from pc_pool.worker import worker_loop

__all__ = ["BasePool", "PoolStates"]

_START_TIMEOUT = 60.0  # seconds the first workers get to start before the constructor gives up


class BasePool(PoolFrontend):
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
        optional_positive_int("maxtasksperchild", maxtasksperchild)
        self._processes = processes
        self._engine = EngineState(processes, p2p=self._p2p)
        self._cache = self._engine.cache
        self._terminate_lock = threading.Lock()
        self.setup_queues()
        self._worker_set = WorkerSet(
            self._engine,
            context if context is not None else multiprocessing.get_context("spawn"),
            type(self).worker,
            initializer=initializer,
            initargs=tuple(initargs),
            maxtasks=maxtasksperchild,
            copy_tensor=self._copy_tensor,
            recurse=self._recurse,
            daemon=self._daemon,
        )
        default_send = type(self).pool_inqueue_put is BasePool.pool_inqueue_put
        self._feeder = Feeder(
            self._engine,
            self.pool_inqueue_put,
            copy_tensor=self._copy_tensor,
            recurse=self._recurse,
            send_batch=self._worker_set.send_batch if default_send else None,
        )
        self._collector = ResultThread(self._engine, self._worker_set, self, copy_tensor=self._copy_tensor)
        error = self._collector.start(_START_TIMEOUT)
        if error is not None:
            self.terminate()
            raise error
        self._feeder.start()
        register_pool(self)

    # Read-only views kept for code (and tests) written against the original attribute names.
    @property
    def _state(self) -> PoolStates:
        return self._engine.state

    @property
    def _workers(self) -> list[WorkerHandle | None]:
        return self._engine.workers

    # ========================================================================================================
    # Overridable hooks (the original API's names; each delegates to the object that owns the concern)
    # ========================================================================================================
    def setup_queues(self) -> None:
        """Create the parent-side queues: the ready deques and the result thread's wakeup pipe.

        The task and result pipes themselves are created per worker by :meth:`repopulate_pool`.
        """
        self._engine.reset_queues()

    def pool_inqueue_put(self, obj: Any) -> int:
        """Send one task message ``obj = (worker_index, header, payload)`` to that worker's task pipe.

        Called by the worker's feeder thread, the only writer of that pipe.

        Returns:
            The number of bytes written (used to tell, after a death, which chunks the worker never read).
        """
        return self._worker_set.send(obj)

    def pool_outqueue_get(self, timeout: float) -> list[tuple[int, Any]]:
        """Wait up to ``timeout`` seconds for worker events; return them as ``(worker_index, event)`` pairs.

        An event is a received message ``(header, payload)``, or ``None`` when the worker's process ended.

        Raises:
            TimeoutError: Nothing happened within ``timeout``.
            OSError: The pool is shutting down.
        """
        return self._worker_set.wait_events(timeout)

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
        self._worker_set.repopulate(self._worker_context)

    def maintain_pool(self) -> None:
        """Reap workers whose process ended (crash or retirement) and start replacements."""
        self._collector.maintain(self)

    def join_workers(self) -> None:
        """Wait until all workers have exited (each is given ``KILL_GRACE`` seconds, then killed)."""
        self._worker_set.join_all()

    def terminate_workers(self) -> None:
        """Force terminate all workers: SIGTERM, then SIGKILL after ``KILL_GRACE`` seconds."""
        self._worker_set.terminate_all()

    def _worker_context(self, index: int) -> Any:
        """The context object of worker ``index`` (``CtxPool`` overrides it); the base pool has none."""
        return NO_CONTEXT

    # ========================================================================================================
    # Lifecycle
    # ========================================================================================================
    def _check_running(self) -> None:
        self._engine.check_running()

    def close(self) -> None:
        """Stop accepting work; pending work drains, then the workers exit. Call :meth:`join` to wait."""
        st = self._engine
        with st.cond:
            if st.state is PoolStates.RUN:
                st.state = PoolStates.CLOSE
            st.cond.notify_all()
        self._lift_read_ahead()
        st.wake()

    def terminate(self) -> None:
        """Fail all pending results with :class:`~pc_pool.PoolTerminatedError`; stop the workers (bounded)."""
        with self._terminate_lock:
            self._engine.fail_everything(
                PoolTerminatedError("the pool was terminated before this result arrived")
            )
            self._collector.join(TICK + 2 * KILL_GRACE)
            self._feeder.join(TICK)
            unregister_pool(self)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the workers and the pool's threads to exit after :meth:`close` or :meth:`terminate`.

        Args:
            timeout: Seconds to wait at most; ``None`` waits until pending work has drained. Every failure
                ends that too: a dead worker fails its chunk and the rest drains, ``terminate()`` from another
                thread ends it at once, and Ctrl-C terminates the pool and propagates. Only a task that never
                returns keeps it waiting.

        Raises:
            ValueError: The pool is still running (call ``close()`` or ``terminate()`` first).
            TimeoutError: The pool did not shut down within ``timeout``.
        """
        if self._engine.state is PoolStates.RUN:
            raise ValueError("Pool is still running; call close() or terminate() before join()")
        try:
            if not wait_in_slices(self._collector.join, timeout):
                raise TimeoutError(f"pool did not shut down within {timeout} s")
        except KeyboardInterrupt:
            self._handle_interrupt()
            raise
        self._feeder.join(TICK)
        unregister_pool(self)

    def __enter__(self) -> BasePool:
        self._check_running()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.terminate()

    def _handle_interrupt(self) -> None:
        """Ctrl-C while a caller waits on this pool: terminate it (the KeyboardInterrupt propagates)."""
        self.terminate()

    # ========================================================================================================
    # Submission (caller threads)
    # ========================================================================================================
    def _open_job(self, func: Callable[..., Any], mode: int, result: Any) -> Job:
        result._owner = self
        job = Job(result._job, func, mode, result)
        self._engine.open_job(job)
        return job

    def _add_chunk(self, token: Job, index: int, items: list[Any]) -> bool:
        return self._engine.add_chunk(token, index, items)

    def _end_job(self, token: Job, done: bool) -> None:
        if done:
            self._engine.drop_job(token)

    def _submit(self, func: Callable[..., Any], mode: int, chunks: list[list[Any]], result: Any) -> None:
        result._owner = self
        job = Job(result._job, func, mode, result)
        if len(chunks) != 1 or self._p2p:
            self._engine.submit(job, chunks)
            return
        # One chunk (apply): if a worker is idle, send it from this thread (no hop through the feeder). Its
        # task pipe is empty, so the write never waits on other work.
        claimed = self._engine.submit_direct(job, chunks[0])
        if claimed is None:
            return
        w, chunk = claimed
        try:
            with w.send_lock:  # a feeder still finishing its last send to w (already answered) is done
                pass
            self._feeder.send_chunks(w, [chunk], self.pool_inqueue_put)
        except KeyboardInterrupt:
            self._handle_interrupt()  # a message may be cut short in the pipe: the pool cannot go on
            raise
        finally:
            self._engine.end_direct(w)
