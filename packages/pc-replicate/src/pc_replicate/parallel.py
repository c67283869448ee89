"""``Parallel``: run ``Parallelizable.forward_backward`` on items in worker threads.

Two queues plus error records and sequence numbers::

    put(x) ──(seq, x, state)──► in-queue ──► worker threads ──(seq, ok, value)──► out-queue ──► get()
      └── the first num_workers items run inline when serial_init ──────────────────┘

Each item carries the caller's grad / inference / autocast state, captured at ``put``, and the CUDA device and
current stream of its first CUDA tensor; the worker re-enters them. A worker catches everything, so a failing
item becomes an error record that ``get`` re-raises (a lost error would leave ``get`` blocked forever).
Workers are daemon threads that hold the queues and the parallelizable but never the ``Parallel`` itself, so a
``weakref.finalize`` stops them when the object is collected or the interpreter exits.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from pc_replicate import _threadstate

__all__ = ["CLOSE_TIMEOUT", "Parallel", "Parallelizable"]

logger = logging.getLogger(__name__)

#: Default seconds ``close`` waits for each worker thread to finish its current item.
CLOSE_TIMEOUT = 10.0


class Parallelizable:
    """Base class for a unit of work run by :class:`Parallel`: override :meth:`forward_backward`.

    Example::

        class ParallelNet(Parallelizable):
            def __init__(self, net: torch.nn.Module) -> None:
                self.net = net
                self.loss = torch.nn.CrossEntropyLoss()

            def forward_backward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
                data, label = x
                loss = self.loss(self.net(data), label)
                loss.backward()
                return loss.detach()
    """

    def forward_backward(self, x: Any) -> Any:
        """Run the forward and backward computation on one item and return its result.

        Raises:
            NotImplementedError: unless overridden.
        """
        raise NotImplementedError(f"{type(self).__name__} must override forward_backward(x)")


@dataclass(frozen=True)
class _Item:
    seq: int
    value: Any
    state: _threadstate.ThreadState
    device: torch.device | None
    stream: torch.cuda.Stream | None


@dataclass(frozen=True)
class _Result:
    seq: int
    ok: bool
    value: Any  # the result, or the exception when not ok


class _Failure:
    """The first error of any item; shared by the workers and the ``Parallel``, which workers never hold."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.error: BaseException | None = None

    def record(self, exc: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = exc


_STOP = object()
# Put on the out-queue when more get() calls wait than results can still come (close() dropped items): the
# getter that receives it and finds itself surplus raises instead of waiting forever.
_WAKE = _Result(-1, False, None)


def _run_item(parallelizable: Any, item: _Item, failure: _Failure) -> _Result:
    try:
        with _threadstate.cuda_context(item.device, item.stream), item.state.enter():
            return _Result(item.seq, True, parallelizable.forward_backward(item.value))
    except BaseException as exc:  # never let a worker die: the error goes back to get()
        failure.record(exc)
        return _Result(item.seq, False, exc)


def _call_inline(parallelizable: Any, seq: int, x: Any, failure: _Failure) -> _Result:
    try:
        return _Result(seq, True, parallelizable.forward_backward(x))
    except BaseException as exc:  # surfaces at get(), like a worker's error
        failure.record(exc)
        return _Result(seq, False, exc)


def _worker(
    in_queue: queue.SimpleQueue[Any],
    out_queue: queue.SimpleQueue[_Result],
    parallelizable: Any,
    failure: _Failure,
) -> None:
    while True:
        # An idle worker waits for work without a timeout; close() and the finalizer wake it with _STOP.
        item = in_queue.get()
        if item is _STOP:
            return
        out_queue.put(_run_item(parallelizable, item, failure))


def _drop_unstarted(in_queue: queue.SimpleQueue[Any]) -> list[_Item]:
    """Take every item no worker has started off the queue and return them."""
    dropped: list[_Item] = []
    while True:
        try:
            item = in_queue.get_nowait()
        except queue.Empty:
            return dropped
        if item is not _STOP:
            dropped.append(item)


def _shutdown(
    in_queue: queue.SimpleQueue[Any], threads: list[threading.Thread], timeout: float
) -> list[_Item]:
    """Drop unstarted items, stop the workers, join them with a bound; return the dropped items."""
    dropped = _drop_unstarted(in_queue)
    for _ in threads:
        in_queue.put(_STOP)
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    alive = [thread.name for thread in threads if thread.is_alive()]
    if alive:
        logger.warning(
            "Parallel workers still running after %.1f s: %s (daemon threads, left behind)", timeout, alive
        )
    return dropped


class Parallel:
    """Run ``parallelizable.forward_backward(x)`` for each ``put(x)`` in threads; ``get()`` the results.

    Args:
        num_workers: the number of worker threads; ``0`` runs every item inline in ``put`` (for debugging).
        parallelizable: the unit of work: a :class:`Parallelizable` (or any object with ``forward_backward``).
        serial_init: run the first ``num_workers`` items inline, so that lazy modules, a first
            ``torch.compile`` call or per-thread library handles initialize one at a time.
        ordered: ``get`` returns results in ``put`` order instead of completion order.

    Raises:
        TypeError: if ``num_workers`` is not an int or ``parallelizable`` has no callable
        ``forward_backward``. ValueError: if ``num_workers`` is negative.

    After an item fails, ``get`` re-raises its error (the original object, once), and ``put`` raises
    ``RuntimeError`` chained to it, so the results of a failed batch never leak into the next one; build a new
    ``Parallel`` to go on. ``Parallel`` does not reduce gradients: a module shared by the workers accumulates
    into the same ``.grad`` (AccumulateGrad locks; the summation order varies).

    Example::

        with Parallel(2, ParallelNet(net), ordered=True) as parallel:
            for x in batch.chunk(2):
                parallel.put(x)
            losses = [parallel.get(timeout=60) for _ in range(2)]
    """

    def __init__(
        self,
        num_workers: int,
        parallelizable: Parallelizable,
        serial_init: bool = True,
        *,
        ordered: bool = False,
    ) -> None:
        if not isinstance(num_workers, int) or isinstance(num_workers, bool):
            raise TypeError(f"num_workers must be an int, got {type(num_workers).__name__} {num_workers!r}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if not callable(getattr(parallelizable, "forward_backward", None)):
            raise TypeError(
                "parallelizable must have a callable forward_backward(x), got "
                f"{type(parallelizable).__name__}"
            )
        self._parallelizable = parallelizable
        self._num_workers = num_workers
        self._num_serial = num_workers if serial_init else 0
        self._ordered = ordered
        self._in_queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._out_queue: queue.SimpleQueue[_Result] = queue.SimpleQueue()
        self._failure = _Failure()
        self._lock = threading.Lock()
        self._next_put = 0
        self._next_get = 0  # ordered mode: the sequence number get() returns next
        self._pending = 0
        self._buffer: dict[int, _Result] = {}
        self._dropped: set[int] = set()
        self._waiting = 0  # get() calls blocked on the out-queue
        self._closed = False
        self._threads = [
            threading.Thread(
                target=_worker,
                args=(self._in_queue, self._out_queue, parallelizable, self._failure),
                name=f"pc-replicate-Parallel-worker-{index}",
                daemon=True,
            )
            for index in range(num_workers)
        ]
        for thread in self._threads:
            thread.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._in_queue, self._threads, CLOSE_TIMEOUT)

    @property
    def num_workers(self) -> int:
        """The number of worker threads (``0``: inline)."""
        return self._num_workers

    @property
    def pending(self) -> int:
        """The number of items put but not yet returned by ``get``."""
        with self._lock:
            return self._pending

    def put(self, x: Any) -> None:
        """Submit ``x``: a worker will call ``parallelizable.forward_backward(x)``.

        The caller's grad, inference and autocast state, and the device and current stream of the first CUDA
        tensor in ``x``, are captured now and re-entered by the worker.

        Raises:
            RuntimeError: after :meth:`close`, or after an item failed (chained to that item's error).
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("Parallel is closed; create a new one to submit more work")
            error = self._failure.error
            if error is not None:
                raise RuntimeError(
                    f"a previous item failed with {type(error).__name__}: {error}; create a new Parallel"
                ) from error
            seq = self._next_put
            self._next_put += 1
            self._pending += 1
            inline = self._num_serial > 0 or not self._threads
            if inline:
                self._num_serial -= 1
        if inline:  # the caller's thread already has the caller's state, device and stream
            result = _call_inline(self._parallelizable, seq, x, self._failure)
            self._out_queue.put(result)
            if not result.ok and not isinstance(result.value, Exception):
                raise result.value  # Ctrl-C / SystemExit stop the caller now (and still surface at get)
            return
        device = _threadstate.find_cuda_device(x)
        self._in_queue.put(_Item(seq, x, _threadstate.capture(), device, _threadstate.current_stream(device)))

    def get(self, timeout: float | None = None) -> Any:
        """Return the next result: in completion order, or in ``put`` order when ``ordered=True``.

        Args:
            timeout: seconds to wait; ``None`` waits until a result arrives. Every item put yields one result
                (a failing item yields its error, and a worker never dies without one), and ``close()`` from
                another thread wakes a ``get`` whose item it dropped, so ``None`` never outlasts the work.

        Returns:
            The value ``forward_backward`` returned.

        Raises:
            RuntimeError: at once when no item is pending, or when ``close()`` dropped what it waited for.
            TimeoutError: if no result arrived within ``timeout`` (the item stays pending).
            BaseException: the error ``forward_backward`` raised for this item, with its original type.
        """
        with self._lock:
            if self._pending == 0:
                raise RuntimeError("get() called with no pending item; put() an item first")
            self._waiting += 1
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            result = self._next_result(deadline, timeout)
        finally:
            with self._lock:
                self._waiting -= 1
        with self._lock:
            self._pending -= 1
        self._wake_surplus()
        if not result.ok:
            raise result.value
        return result.value

    def _receive(self, deadline: float | None, timeout: float | None) -> _Result:
        while True:
            try:
                if deadline is None:
                    result = self._out_queue.get()
                else:
                    result = self._out_queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(
                    f"Parallel.get: no result within {timeout} s ({self.pending} item(s) pending)"
                ) from None
            if result is not _WAKE:
                return result
            with self._lock:
                if self._waiting > self._pending:
                    raise RuntimeError(
                        "Parallel.get: no result can come for this get(): close() dropped the items it "
                        "waited for"
                    )

    def _wake_surplus(self) -> None:
        """Wake the get() calls that no pending item can satisfy any more (one ``_WAKE`` each)."""
        with self._lock:
            surplus = self._waiting - max(self._pending, 0)
        for _ in range(surplus):
            self._out_queue.put(_WAKE)

    def _next_result(self, deadline: float | None, timeout: float | None) -> _Result:
        if not self._ordered:
            return self._receive(deadline, timeout)
        while True:
            with self._lock:
                while self._next_get in self._dropped:
                    self._dropped.discard(self._next_get)
                    self._next_get += 1
                wanted = self._next_get
                result = self._buffer.pop(wanted, None)
                if result is not None:
                    self._next_get += 1
                    return result
            received = self._receive(deadline, timeout)
            with self._lock:
                self._buffer[received.seq] = received

    def close(self) -> None:
        """Stop the workers (after their current item) and drop items not yet started. Idempotent.

        Each worker gets ``CLOSE_TIMEOUT`` seconds in all to finish; one still running is left behind as a
        daemon thread (with a warning), so it never blocks interpreter exit.
        """
        with self._lock:
            self._closed = True
        # Unstarted items leave before the workers are told to stop, so none of them can start meanwhile.
        dropped = _drop_unstarted(self._in_queue) if self._finalizer.alive else []
        if dropped:
            with self._lock:
                self._pending -= len(dropped)
                self._dropped.update(item.seq for item in dropped)
            self._wake_surplus()
            logger.debug("Parallel.close dropped %d unstarted item(s)", len(dropped))
        self._finalizer()

    def __enter__(self) -> Parallel:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"Parallel(num_workers={self._num_workers}, ordered={self._ordered}, {state}, "
            f"pending={self.pending})"
        )
