"""Result handles: :class:`AsyncResult`, :class:`MapResult`, :class:`IMapIterator` and its unordered twin.

A handle is registered in its pool's job table (``cache``) under its job id and filled chunk by chunk by the
pool's threads through ``_set(chunk_index, success, value)``; ``_fail(exc)`` fails whatever is still pending
(``terminate()``). Callbacks run in the thread that completes the handle, *before* waiters wake (the stdlib
order); a callback that raises is logged to the ``pc_pool.results`` logger (a child of ``pc_pool``) and never
breaks the pool.

Waits and what ends them: ``get``, ``wait`` and ``next`` take a ``timeout`` (``multiprocessing.TimeoutError``
reports an expired one); ``None`` (the default, the stdlib's meaning) waits for the result, and every failure
of the pool produces one, so it cannot wait forever on a broken pool:

* the worker running the task dies: :class:`~pc_pool.WorkerDiedError` (the result thread watches every
  worker's process sentinel);
* ``terminate()`` (also from another thread, ``with`` exit, interpreter exit):
  :class:`~pc_pool.PoolTerminatedError`;
* the pool breaks (an initializer raises, workers keep dying before they are ready, a worker sends a reply
  that matches no task, the result thread crashes): :class:`~pc_pool.PoolTerminatedError` with the cause;
* Ctrl-C in the waiting thread: the owning pool is terminated once and ``KeyboardInterrupt`` propagates.

What a ``None`` wait does *not* end is a task that runs forever in a live worker (or, in a thread pool, a
running call): pass a ``timeout`` where that can happen.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from pc_pool._signals import wait_in_slices

__all__ = ["AsyncResult", "IMapIterator", "IMapUnorderedIterator", "MapResult"]

_log = logging.getLogger(__name__)


class _Owner(Protocol):
    def _handle_interrupt(self) -> None: ...  # pragma: no cover - protocol


def _run_callback(callback: Callable[[Any], object] | None, arg: Any, what: str) -> None:
    if callback is None:
        return
    try:
        callback(arg)
    except Exception:
        # A raising callback must not kill the thread that delivers results (the stdlib bug): log and go on.
        _log.exception("pc_pool %s raised; the result is delivered anyway", what)


class AsyncResult:
    """Class whose instances are returned by ``Pool.apply_async()``.

    Args:
        job: The job id (the key in ``cache``).
        cache: The pool's job table; the handle adds itself and removes itself once complete.
        callback: Called with the value on success, in a pool thread, before waiters wake.
        error_callback: Called with the exception on failure, likewise.
    """

    def __init__(
        self,
        job: int,
        cache: dict[int, Any],
        callback: Callable[[Any], object] | None = None,
        error_callback: Callable[[BaseException], object] | None = None,
    ) -> None:
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable or None, got {type(callback).__name__}")
        if error_callback is not None and not callable(error_callback):
            raise TypeError(f"error_callback must be callable or None, got {type(error_callback).__name__}")
        self._job = job
        self._cache = cache
        self._callback = callback
        self._error_callback = error_callback
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._success: bool | None = None
        self._value: Any = None
        self._owner: _Owner | None = None
        cache[job] = self

    # -- waiting ---------------------------------------------------------------------------------------------
    def ready(self) -> bool:
        """Return whether the call has completed (successfully or not)."""
        return self._event.is_set()

    def successful(self) -> bool:
        """Return whether the call completed without raising.

        Raises:
            ValueError: The result is not ready yet.
        """
        if not self._event.is_set():
            raise ValueError(f"{self!r} not ready")
        return bool(self._success)

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the result is available or ``timeout`` seconds pass (``None``: the module's wake-ups).

        It returns, without raising, when the result is a failure too (worker death, ``terminate()``).
        """
        owner = self._owner
        try:
            wait_in_slices(self._event.wait, timeout)
        except KeyboardInterrupt:
            if owner is not None:
                owner._handle_interrupt()
            raise

    def get(self, timeout: float | None = None) -> Any:
        """Return the result when it arrives.

        Args:
            timeout: Seconds to wait; ``None`` waits until the result or an error arrives (a dead worker,
                ``terminate()``, a broken pool and Ctrl-C always end it; a task that never returns does not).

        Returns:
            The value the function returned.

        Raises:
            multiprocessing.TimeoutError: The result did not arrive within ``timeout``.
            BaseException: The exception the remote call raised, with its remote traceback as ``__cause__``;
                :class:`~pc_pool.WorkerDiedError` or :class:`~pc_pool.PoolTerminatedError` if it never ran.
        """
        self.wait(timeout)
        if not self._event.is_set():
            raise multiprocessing.TimeoutError(f"result of job {self._job} not ready after {timeout} s")
        if self._success:
            return self._value
        raise self._value

    # -- filling (pool side) ---------------------------------------------------------------------------------
    def _set(self, index: int, success: bool, value: Any) -> bool:
        """Store chunk ``index`` (its list of results, or an exception); return True when complete."""
        with self._lock:
            if self._event.is_set():
                return True
            self._success = success
            self._value = value[0] if success else value
        self._finish()
        return True

    def _fail(self, exc: BaseException) -> None:
        """Fail the result now unless it is already complete."""
        with self._lock:
            if self._event.is_set():
                return
            self._success = False
            self._value = exc
        self._finish()

    def _finish(self) -> None:
        if self._success:
            _run_callback(self._callback, self._value, "callback")
        else:
            _run_callback(self._error_callback, self._value, "error_callback")
        self._cache.pop(self._job, None)
        self._owner = None
        self._event.set()


class MapResult(AsyncResult):
    """Class whose instances are returned by ``Pool.map_async()`` and ``Pool.starmap_async()``.

    The value is the list of all results in order. The first failing chunk's exception is kept; the handle is
    complete once every chunk has answered (or the pool was terminated).

    Args:
        job: The job id.
        cache: The pool's job table.
        chunksize: Number of elements per chunk.
        length: Number of elements.
        callback: Called with the list of results on success.
        error_callback: Called with the first exception on failure.
    """

    def __init__(
        self,
        job: int,
        cache: dict[int, Any],
        chunksize: int,
        length: int,
        callback: Callable[[Any], object] | None = None,
        error_callback: Callable[[BaseException], object] | None = None,
    ) -> None:
        super().__init__(job, cache, callback, error_callback)
        self._success = True
        self._value = [None] * length
        self._chunksize = chunksize
        self._number_left = -(-length // chunksize) if length else 0
        if self._number_left == 0:
            self._finish()

    def _set(self, index: int, success: bool, value: Any) -> bool:
        with self._lock:
            if self._event.is_set():
                return True
            if success:
                if self._success:
                    self._value[index * self._chunksize : (index + 1) * self._chunksize] = value
            elif self._success:
                self._success = False
                self._value = value
            self._number_left -= 1
            if self._number_left > 0:
                return False
        self._finish()
        return True

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._event.is_set():
                return
            if self._success:
                self._success = False
                self._value = exc
            self._number_left = 0
        self._finish()


class IMapIterator:
    """Class whose instances are returned by ``Pool.imap()``: results one at a time, in order.

    Elements travel to the workers in chunks of ``chunksize``. A chunk whose task failed raises its exception
    from :meth:`next` once, in place of that chunk's results, as the stdlib's ``imap`` does (with the default
    ``chunksize=1``: at that element); iteration may continue past it. Over a lazy iterable (anything but a
    list, tuple or range) the elements are read by a pool thread while results come back; if the iterable
    raises, the results of the elements before the failure come first, then :meth:`next` raises the
    iterable's exception.

    Args:
        job: The job id.
        cache: The pool's job table.
        length: Number of elements; ``None`` while a lazy iterable is still being read.
        chunksize: Elements per chunk (the last chunk may be shorter).
    """

    def __init__(self, job: int, cache: dict[int, Any], length: int | None, *, chunksize: int = 1) -> None:
        self._job = job
        self._cache = cache
        self._length = length
        self._chunksize = chunksize
        self._chunks = None if length is None else -(-length // chunksize)
        self._cond = threading.Condition(threading.Lock())
        self._items: dict[int, tuple[bool, Any]] = {}  # chunk index -> (success, its values or its exception)
        self._current: collections.deque[Any] = collections.deque()  # values of a chunk being returned
        self._index = 0  # chunks taken by the caller
        self._arrived = 0  # chunks arrived
        self._terminal: BaseException | None = None
        self._input_error: BaseException | None = None
        self._read_ahead_lifted = False
        self._owner: _Owner | None = None
        if length is None or length:
            cache[job] = self

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return self.next()

    def __len__(self) -> int:
        """The number of elements; a ``TypeError`` while a lazy iterable has not been read to its end."""
        length = self._length
        if length is None:
            raise TypeError("the length of imap over a lazy iterable is known once the iterable is exhausted")
        return length

    def _settled(self) -> bool:
        return (
            bool(self._current)
            or self._available()
            or self._terminal is not None
            or (self._chunks is not None and self._index >= self._chunks)
        )

    def _available(self) -> bool:
        return self._index in self._items

    def _pop(self) -> tuple[bool, Any]:
        return self._items.pop(self._index)

    def _complete(self) -> bool:
        """Whether every chunk arrived (call with the condition held)."""
        return self._chunks is not None and self._arrived >= self._chunks

    def next(self, timeout: float | None = None) -> Any:
        """Return the next result within ``timeout`` seconds (``None``: the module's wake-ups end the wait).

        Raises:
            StopIteration: Every result has been returned.
            multiprocessing.TimeoutError: The next result did not arrive within ``timeout``.
            BaseException: The exception of the task that produced this element (or chunk).
        """
        owner = self._owner
        try:
            return self._next(timeout)
        except KeyboardInterrupt:
            # Outside the condition: terminating the pool fails this iterator too, under the same condition.
            if owner is not None:
                owner._handle_interrupt()
            raise

    def _next(self, timeout: float | None) -> Any:
        with self._cond:
            if self._current:
                value = self._current.popleft()
                if not self._current:
                    self._cond.notify_all()  # the chunk is consumed: the input thread may read one more
                return value
            ok = wait_in_slices(lambda t: self._cond.wait_for(self._settled, t), timeout)
            if not ok:
                raise multiprocessing.TimeoutError(
                    f"result of chunk {self._index} of job {self._job} not ready"
                )
            if self._available():
                success, value = self._pop()
            elif self._chunks is not None and self._index >= self._chunks:
                error, self._input_error = self._input_error, None
                if error is None:
                    raise StopIteration
                raise error  # every element before the iterable failed was returned: now its exception
            else:
                success, value = False, self._terminal
            self._index += 1
            self._cond.notify_all()  # the input thread reads ahead of this position
            if success:
                self._current.extend(value)
                return self._current.popleft()
        raise value

    def _set(self, index: int, success: bool, value: Any) -> bool:
        with self._cond:
            if self._terminal is not None:
                return True
            self._items[index] = (success, value)
            self._arrived += 1
            done = self._complete()
            self._cond.notify_all()
        if done:
            self._cache.pop(self._job, None)
            self._owner = None
        return done

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._complete():
                return
            self._terminal = exc
            self._cond.notify_all()
        self._cache.pop(self._job, None)
        self._owner = None

    # -- the input thread of a lazy iterable (pc_pool._input) ------------------------------------------------
    def _wait_for_room(self, count: int, read_ahead: int, timeout: float) -> bool | None:
        """Wait until chunk ``count`` may be read: True; False once failed; None after ``timeout``.

        ``read_ahead`` counts chunks past the last chunk the caller took.
        """
        with self._cond:
            ok = self._cond.wait_for(
                lambda: (
                    self._terminal is not None
                    or self._read_ahead_lifted
                    or count < self._index - (1 if self._current else 0) + read_ahead
                ),
                timeout,
            )
            if not ok:
                return None
            return self._terminal is None

    def _end_input(self, chunks: int, length: int, error: BaseException | None) -> bool:
        """The iterable gave ``length`` elements in ``chunks`` chunks (then raised ``error``).

        Returns whether the job is done (every chunk's result arrived, or it was failed).
        """
        with self._cond:
            self._chunks = chunks
            self._length = length
            self._input_error = error
            done = self._terminal is not None or self._arrived >= chunks
            self._cond.notify_all()
        if done:
            self._cache.pop(self._job, None)
            self._owner = None
        return done

    def _lift_read_ahead(self) -> None:
        """The pool is closing: read the rest of the input without waiting for the caller to take results."""
        with self._cond:
            self._read_ahead_lifted = True
            self._cond.notify_all()


class IMapUnorderedIterator(IMapIterator):
    """Class whose instances are returned by ``Pool.imap_unordered()``: results in completion order."""

    def __init__(self, job: int, cache: dict[int, Any], length: int | None, *, chunksize: int = 1) -> None:
        super().__init__(job, cache, length, chunksize=chunksize)
        self._arrivals: collections.deque[tuple[bool, Any]] = collections.deque()

    def _available(self) -> bool:
        return bool(self._arrivals)

    def _pop(self) -> tuple[bool, Any]:
        return self._arrivals.popleft()

    def _set(self, index: int, success: bool, value: Any) -> bool:
        with self._cond:
            if self._terminal is not None:
                return True
            self._arrivals.append((success, value))
            self._arrived += 1
            done = self._complete()
            self._cond.notify_all()
        if done:
            self._cache.pop(self._job, None)
            self._owner = None
        return done
