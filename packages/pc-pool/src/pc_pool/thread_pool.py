"""Thread pools with the pool API: :class:`ThreadPool` and :class:`CtxThreadPool`.

Nothing crosses a process boundary, so nothing is serialized: objects (tensors included) are passed by
reference, and the process-only flags (``is_recursive``, ``is_daemon``, ``is_copy_tensor``, ``share_method``,
``maxtasksperchild``) are accepted and ignored. ``terminate()`` fails every pending result with
:class:`~pc_pool.PoolTerminatedError`; calls already running finish (a thread cannot be interrupted).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from pc_pool._api import PoolFrontend
from pc_pool._protocol import MODE_APPLY, MODE_MAP
from pc_pool._settings import TICK, check_pool_args
from pc_pool._signals import wait_in_slices
from pc_pool.base_pool import PoolStates
from pc_pool.errors import PoolTerminatedError

__all__ = ["CtxThreadPool", "ThreadPool"]

_NO_CONTEXT = object()


class ThreadPool(PoolFrontend):
    """A pool of threads with the process pool's API.

    Args:
        processes: Number of threads (default ``os.cpu_count()``).
        initializer: Called as ``initializer(*initargs)`` in each thread first; if it raises, the pool
            terminates with that cause.
        initargs: Args passed to the init function.
        maxtasksperchild: Ignored (threads are not recycled).
        is_recursive: Ignored (nothing is pickled).
        is_daemon: Ignored (threads are always daemon threads).
        is_copy_tensor: Ignored (objects are passed by reference).
        share_method: Ignored.

    Raises:
        ValueError: ``processes < 1``.
        TypeError: ``initializer`` is not callable.
    """

    def __init__(
        self,
        processes: int | None = None,
        initializer: Callable[..., object] | None = None,
        initargs: Iterable[Any] = (),
        maxtasksperchild: int | None = None,
        is_recursive: bool = False,
        is_daemon: bool = True,
        is_copy_tensor: bool = True,
        share_method: str | None = None,
    ) -> None:
        processes = check_pool_args(processes, initializer)
        self._processes = processes
        self._initializer = initializer
        self._initargs = tuple(initargs)
        self._cache: dict[int, Any] = {}
        self._cond = threading.Condition(threading.Lock())
        self._tasks: collections.deque[tuple[Callable[..., Any], int, int, list[Any], Any]] = (
            collections.deque()
        )
        self._state = PoolStates.RUN
        self._open_inputs = 0  # lazy imap jobs whose input thread may still queue tasks
        self._broken: BaseException | None = None
        # Threads not yet finished; join() waits for 0 under the condition rather than in Thread.join, which a
        # Ctrl-C interrupting it on CPython 3.10-3.12 leaves believing a live thread stopped (gh-90882).
        self._live = processes
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"pc_pool-thread-{i}", daemon=True)
            for i in range(processes)
        ]
        for t in self._threads:
            t.start()

    def _context(self, index: int) -> Any:
        return _NO_CONTEXT

    def _check_running(self) -> None:
        if self._state is not PoolStates.RUN:
            if self._broken is not None:
                raise ValueError(f"Pool not running: it broke because {self._broken!r}") from self._broken
            raise ValueError("Pool not running")

    def _submit(self, func: Callable[..., Any], mode: int, chunks: list[list[Any]], result: Any) -> None:
        result._owner = self
        with self._cond:
            self._check_running()
            for index, items in enumerate(chunks):
                self._tasks.append((func, mode, index, items, result))
            self._cond.notify_all()

    def _open_job(self, func: Callable[..., Any], mode: int, result: Any) -> Any:
        result._owner = self
        with self._cond:
            self._check_running()
            self._open_inputs += 1
        return (func, mode, result)

    def _add_chunk(self, token: Any, index: int, items: list[Any]) -> bool:
        func, mode, result = token
        with self._cond:
            if self._state is PoolStates.TERMINATE:
                return False
            self._tasks.append((func, mode, index, items, result))
            self._cond.notify_all()
        return True

    def _end_job(self, token: Any, done: bool) -> None:
        with self._cond:
            self._open_inputs -= 1
            self._cond.notify_all()

    def _run(self, index: int) -> None:
        try:
            self._serve(index)
        finally:
            with self._cond:
                self._live -= 1
                self._cond.notify_all()

    def _serve(self, index: int) -> None:
        context = self._context(index)
        try:
            if self._initializer is not None:
                self._initializer(*self._initargs)
        except Exception as exc:
            self._broken = exc
            err = PoolTerminatedError(f"the pool broke: a thread failed to initialize ({exc!r})")
            err.__cause__ = exc
            self._fail_all(err)
            return
        while True:
            with self._cond:
                while not self._tasks:
                    if self._state is PoolStates.TERMINATE or (
                        self._state is PoolStates.CLOSE and not self._open_inputs
                    ):
                        return
                    self._cond.wait(TICK)
                func, mode, chunk, items, result = self._tasks.popleft()
            if context is not _NO_CONTEXT:
                func = _bind(func, context)
            try:
                if mode == MODE_APPLY:
                    args, kwds = items[0]
                    values = [func(*args, **kwds)]
                elif mode == MODE_MAP:
                    values = [func(x) for x in items]
                else:
                    values = [func(*x) for x in items]
            except Exception as exc:
                result._set(chunk, False, exc)
            else:
                result._set(chunk, True, values)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            self._state = PoolStates.TERMINATE
            pending = [task[4] for task in self._tasks]
            self._tasks.clear()
            self._cond.notify_all()
        for result in list(self._cache.values()) + pending:
            err = type(exc)(*exc.args)
            err.__cause__ = exc.__cause__
            result._fail(err)

    def close(self) -> None:
        """Stop accepting work; queued work still runs. Call :meth:`join` to wait."""
        with self._cond:
            if self._state is PoolStates.RUN:
                self._state = PoolStates.CLOSE
            self._cond.notify_all()
        self._lift_read_ahead()

    def terminate(self) -> None:
        """Fail every pending result with :class:`~pc_pool.PoolTerminatedError`; running calls finish."""
        self._fail_all(PoolTerminatedError("the pool was terminated before this result arrived"))

    def join(self, timeout: float | None = None) -> None:
        """Wait for the threads to finish after :meth:`close` or :meth:`terminate`.

        Args:
            timeout: Seconds to wait at most; ``None`` waits for queued and running calls.

        Raises:
            ValueError: The pool is still running.
            TimeoutError: The threads did not finish within ``timeout``.
        """
        if self._state is PoolStates.RUN:
            raise ValueError("Pool is still running; call close() or terminate() before join()")

        def threads_exited(seconds: float) -> bool:
            with self._cond:
                return self._cond.wait_for(lambda: self._live == 0, seconds)

        if not wait_in_slices(threads_exited, timeout):
            raise TimeoutError(f"thread pool did not finish within {timeout} s")

    def _handle_interrupt(self) -> None:
        self.terminate()

    def __enter__(self) -> ThreadPool:
        self._check_running()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.terminate()


def _bind(func: Callable[..., Any], context: Any) -> Callable[..., Any]:
    def call(*args: Any, **kwds: Any) -> Any:
        return func(context, *args, **kwds)

    return call


class CtxThreadPool(ThreadPool):
    """Thread pool with a context per thread: thread i calls ``func(worker_contexts[i], *args)``.

    Args:
        processes: Number of threads.
        initializer: Initializer function executed by each thread.
        initargs: Args passed to the init function.
        worker_contexts: One context per thread (``None``: every context is ``None``).

    Raises:
        ValueError: ``Context number is not equal to the number of pool workers.``
    """

    def __init__(
        self,
        processes: int,
        initializer: Callable[..., object] | None = None,
        initargs: Iterable[Any] = (),
        worker_contexts: Sequence[Any] | None = None,
    ) -> None:
        if worker_contexts is not None:
            worker_contexts = list(worker_contexts)
            if len(worker_contexts) != processes:
                raise ValueError(
                    "Context number is not equal to the number of pool workers. "
                    f"(got {len(worker_contexts)} contexts for processes={processes!r})"
                )
        self._contexts = worker_contexts
        super().__init__(processes, initializer, initargs)

    def _context(self, index: int) -> Any:
        return None if self._contexts is None else self._contexts[index]
