"""The caller-facing methods shared by process and thread pools (apply, map, imap, starmap and async forms).

Subclasses provide ``_check_running()`` (raise ``ValueError("Pool not running")``), ``_submit(func, mode,
chunks, result)`` (queue the chunks of one job), ``_processes`` and ``_cache``. ``map`` chunks like the stdlib
(``chunksize = ceil(len / (4 * processes))``); ``imap``/``imap_unordered`` return an iterator whatever
``chunksize``. ``map`` and ``starmap`` read the whole iterable in the caller first, as the stdlib does (so an
iterable that raises raises from the call itself); ``imap`` and ``imap_unordered`` over anything but a list,
tuple or range read it lazily, ``chunksize`` elements at a time, in an input thread with bounded read-ahead
(:mod:`pc_pool._input`) through the subclass hooks ``_open_job``, ``_add_chunk`` and ``_end_job``.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Iterable
from typing import Any

from pc_pool._checks import positive_int
from pc_pool._input import read_ahead_chunks, start_input_thread
from pc_pool._protocol import MODE_APPLY, MODE_MAP, MODE_STAR
from pc_pool.results import AsyncResult, IMapIterator, IMapUnorderedIterator, MapResult

__all__ = ["PoolFrontend", "default_chunksize"]

_job_ids = itertools.count()
_job_ids_lock = threading.Lock()


def _next_job_id() -> int:
    with _job_ids_lock:
        return next(_job_ids)


def default_chunksize(length: int, processes: int) -> int:
    """``ceil(length / (4 * processes))``, at least 1."""
    return max(1, -(-length // (4 * processes)))


def _check_func(func: Any) -> None:
    if not callable(func):
        raise TypeError(f"func must be callable, got {type(func).__name__}: {func!r}")


def _materialize(iterable: Iterable[Any]) -> list[Any]:
    if not hasattr(iterable, "__iter__"):
        raise TypeError(f"iterable must be iterable, got {type(iterable).__name__}")
    return list(iterable)


class PoolFrontend:
    """Base class of the process and thread pools: the stdlib pool call API on top of ``_submit``.

    It holds no state of its own: subclasses provide ``_processes``, ``_cache``, ``_check_running``,
    ``_submit``, ``_handle_interrupt`` and, for lazy iterables, ``_open_job``, ``_add_chunk``, ``_end_job``.
    """

    _processes: int
    _cache: dict[int, Any]

    def _check_running(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _submit(self, func: Callable[..., Any], mode: int, chunks: list[list[Any]], result: Any) -> None:
        raise NotImplementedError  # pragma: no cover - abstract

    def _handle_interrupt(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _open_job(self, func: Callable[..., Any], mode: int, result: Any) -> Any:  # pragma: no cover
        """Register a job whose chunks come later; return the token ``_add_chunk`` and ``_end_job`` take."""
        raise NotImplementedError

    def _add_chunk(self, token: Any, index: int, items: list[Any]) -> bool:  # pragma: no cover - abstract
        """Queue chunk ``index`` of an open job; False when the job takes no more (terminated, broken)."""
        raise NotImplementedError

    def _end_job(self, token: Any, done: bool) -> None:  # pragma: no cover - abstract
        """No more chunks come for this job; ``done``: every result already arrived (drop the job)."""
        raise NotImplementedError

    def _lift_read_ahead(self) -> None:
        """On close: let the input threads read the rest of their iterables without waiting for the caller."""
        for result in list(self._cache.values()):
            lift = getattr(result, "_lift_read_ahead", None)
            if lift is not None:
                lift()

    def size(self) -> int:
        """Return the number of workers of the pool."""
        return self._processes

    # -- apply -----------------------------------------------------------------------------------------------
    def apply(
        self, func: Callable[..., Any], args: Iterable[Any] = (), kwds: dict[str, Any] | None = None
    ) -> Any:
        """Equivalent of ``func(*args, **kwds)``, run in a worker.

        Args:
            func: Function to call (lambdas and closures work).
            args: Arguments provided to the function call.
            kwds: Keyword arguments provided to the function call.

        Returns:
            Function call result.
        """
        return self.apply_async(func, args, kwds).get()

    def apply_async(
        self,
        func: Callable[..., Any],
        args: Iterable[Any] = (),
        kwds: dict[str, Any] | None = None,
        callback: Callable[[Any], object] | None = None,
        error_callback: Callable[[BaseException], object] | None = None,
    ) -> AsyncResult:
        """Asynchronous version of :meth:`apply`.

        Args:
            func: Function to call.
            args: Arguments provided to the function call.
            kwds: Keyword arguments provided to the function call.
            callback: Callback function to apply on the result.
            error_callback: Callback function to apply on the exception instance.

        Returns:
            An instance of :class:`~pc_pool.AsyncResult`.

        Raises:
            ValueError: The pool is not running.
            TypeError: ``func`` is not callable or ``kwds`` is not a mapping.
        """
        self._check_running()
        _check_func(func)
        if kwds is not None and not isinstance(kwds, dict):
            raise TypeError(f"kwds must be a dict or None, got {type(kwds).__name__}")
        result = AsyncResult(_next_job_id(), self._cache, callback, error_callback)
        self._submit(func, MODE_APPLY, [[(tuple(args), dict(kwds or {}))]], result)
        return result

    # -- map / starmap ---------------------------------------------------------------------------------------
    def _map_async(
        self,
        func: Callable[..., Any],
        iterable: Iterable[Any],
        chunksize: int | None,
        callback: Callable[[Any], object] | None,
        error_callback: Callable[[BaseException], object] | None,
        mode: int,
    ) -> MapResult:
        self._check_running()
        _check_func(func)
        items = _materialize(iterable)
        size = (
            default_chunksize(len(items), self._processes)
            if chunksize is None
            else positive_int("chunksize", chunksize)
        )
        result = MapResult(_next_job_id(), self._cache, size, len(items), callback, error_callback)
        if items:
            self._submit(func, mode, [items[i : i + size] for i in range(0, len(items), size)], result)
        return result

    def map(
        self, func: Callable[[Any], Any], iterable: Iterable[Any], chunksize: int | None = None
    ) -> list[Any]:
        """Apply ``func`` to each element of ``iterable`` and return the results in order.

        Args:
            func: Function to call.
            iterable: A collection of single arguments provided to the function call.
            chunksize: Size of the chunks of ``iterable`` sent to workers (default ``ceil(len / (4 * n))``).

        Returns:
            A list of the results.
        """
        return self.map_async(func, iterable, chunksize).get()  # type: ignore[no-any-return]

    def map_async(
        self,
        func: Callable[[Any], Any],
        iterable: Iterable[Any],
        chunksize: int | None = None,
        callback: Callable[[Any], object] | None = None,
        error_callback: Callable[[BaseException], object] | None = None,
    ) -> MapResult:
        """Asynchronous version of :meth:`map`.

        Args:
            func: Function to call.
            iterable: A collection of single arguments provided to the function call.
            chunksize: Size of the chunks of ``iterable`` sent to workers.
            callback: Callback function to apply on the list of results.
            error_callback: Callback function to apply on the first exception.

        Returns:
            An instance of :class:`~pc_pool.MapResult`.
        """
        return self._map_async(func, iterable, chunksize, callback, error_callback, MODE_MAP)

    def starmap(
        self, func: Callable[..., Any], iterable: Iterable[Iterable[Any]], chunksize: int | None = None
    ) -> list[Any]:
        """Like :meth:`map`, but each element is unpacked as arguments: ``func(*element)``.

        Args:
            func: Function to call.
            iterable: A collection of tuples of arguments provided to the function call.
            chunksize: Size of the chunks of ``iterable`` sent to workers.

        Returns:
            A list of the results.
        """
        return self.starmap_async(func, iterable, chunksize).get()  # type: ignore[no-any-return]

    def starmap_async(
        self,
        func: Callable[..., Any],
        iterable: Iterable[Iterable[Any]],
        chunksize: int | None = None,
        callback: Callable[[Any], object] | None = None,
        error_callback: Callable[[BaseException], object] | None = None,
    ) -> MapResult:
        """Asynchronous version of :meth:`starmap`.

        Args:
            func: Function to call.
            iterable: A collection of tuples of arguments provided to the function call.
            chunksize: Size of the chunks of ``iterable`` sent to workers.
            callback: Callback function to apply on the list of results.
            error_callback: Callback function to apply on the first exception.

        Returns:
            An instance of :class:`~pc_pool.MapResult`.
        """
        return self._map_async(func, iterable, chunksize, callback, error_callback, MODE_STAR)

    # -- imap ------------------------------------------------------------------------------------------------
    def _imap(
        self, func: Callable[[Any], Any], iterable: Iterable[Any], chunksize: int, cls: type[IMapIterator]
    ) -> IMapIterator:
        self._check_running()
        _check_func(func)
        positive_int("chunksize", chunksize)
        if not isinstance(iterable, (list, tuple, range)):
            if not hasattr(iterable, "__iter__"):
                raise TypeError(f"iterable must be iterable, got {type(iterable).__name__}")
            iterator = iter(iterable)
            lazy = cls(_next_job_id(), self._cache, None, chunksize=chunksize)
            token = self._open_job(func, MODE_MAP, lazy)
            start_input_thread(
                iterator,
                lazy,
                functools.partial(self._add_chunk, token),
                functools.partial(self._end_job, token),
                read_ahead_chunks(self._processes, chunksize),
                chunksize,
            )
            return lazy
        items = list(iterable)
        result = cls(_next_job_id(), self._cache, len(items), chunksize=chunksize)
        if items:
            chunks = [list(items[i : i + chunksize]) for i in range(0, len(items), chunksize)]
            self._submit(func, MODE_MAP, chunks, result)
        return result

    def imap(self, func: Callable[[Any], Any], iterable: Iterable[Any], chunksize: int = 1) -> IMapIterator:
        """Like :meth:`map`, but yields results one at a time, in order.

        Args:
            func: Function to call.
            iterable: A collection of single arguments provided to the function call.
            chunksize: Size of the chunks sent to workers.

        Returns:
            An :class:`~pc_pool.IMapIterator`. An iterable other than a list, tuple or range is read lazily,
            ``chunksize`` elements at a time, as the stdlib does: the call returns at once (an endless
            generator works), at most ``max(8 * processes, chunksize)`` elements are read past the last
            result taken, and if the iterable raises, the results of the elements before come first, then
            ``next()`` raises its exception. A chunk whose task raised raises once, in place of its results.
        """
        return self._imap(func, iterable, chunksize, IMapIterator)

    def imap_unordered(
        self, func: Callable[[Any], Any], iterable: Iterable[Any], chunksize: int = 1
    ) -> IMapIterator:
        """Like :meth:`imap`, but results come in completion order.

        Args:
            func: Function to call.
            iterable: A collection of single arguments provided to the function call.
            chunksize: Size of the chunks sent to workers.

        Returns:
            An :class:`~pc_pool.IMapUnorderedIterator`. The iterable is read lazily as by :meth:`imap`;
            results come a chunk at a time, in the order the chunks complete.
        """
        return self._imap(func, iterable, chunksize, IMapUnorderedIterator)

    # -- misc ------------------------------------------------------------------------------------------------
    def __reduce__(self) -> Any:
        raise NotImplementedError("pool objects cannot be passed between processes or pickled")
