"""Run replicas in threads: a daemon thread per replica, with the caller's torch state and an abort path.

``torch.nn.parallel.parallel_apply`` joins every thread before it re-raises, so one replica that fails while
its peers wait on a synchronisation (SyncBN) hangs the forward. Here::

    caller ──start──► worker 0 ─┐   a worker that raises records (index, device, exc) and, if it is the first,
                      worker 1 ─┤   calls __data_parallel_abort__(exc) on every module of every replica, which
                      ...       ─┤   releases peers blocked in a sync; the caller wakes on the first failure,
    caller ◄──notify───────────┘   joins the others for at most ABORT_JOIN_TIMEOUT s, then re-raises.

Each worker re-enters the caller's grad / inference / autocast state and, on CUDA, the replica's device and
the caller's current stream on it. The threads are started for the call, or taken from a
:class:`~pc_replicate._pool.ReplicaThreads` that keeps them between calls (what
``ReplicationCallbackDataParallel`` does).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pc_replicate import _threadstate
from pc_replicate._pool import ReplicaThreads

__all__ = ["ABORT_JOIN_TIMEOUT", "abort_replicas", "apply_replicas"]

logger = logging.getLogger(__name__)

#: Seconds the caller waits for the other replicas to finish after one failed, before it re-raises anyway.
ABORT_JOIN_TIMEOUT = 10.0


def abort_replicas(replicas: Sequence[nn.Module], exc: BaseException) -> None:
    """Call ``__data_parallel_abort__(exc)`` on every module of every replica that defines it.

    Errors raised by a hook are logged and ignored, so one faulty hook cannot stop the others from running.
    """
    for replica in replicas:
        for module in replica.modules():
            hook = getattr(module, "__data_parallel_abort__", None)
            if callable(hook):
                try:
                    hook(exc)
                except Exception:
                    logger.exception("__data_parallel_abort__ of %s raised", type(module).__name__)


def _is_secondary(exc: BaseException) -> bool:
    # A SyncAbortedError (pc-sync) is the echo of another replica's failure; matched by name so that this
    # package does not import pc-sync.
    return any(cls.__name__ == "SyncAbortedError" for cls in type(exc).__mro__)


def _annotate(exc: BaseException, index: int, device: torch.device | None) -> BaseException:
    where = f"in replica {index}" + (f" on device {device}" if device is not None else "")
    note = f"pc_replicate: raised {where}"
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10: PEP 678's attribute, which 3.10's traceback printer does not show
        with contextlib.suppress(AttributeError):  # no __dict__: nowhere to keep it
            exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]
    return exc


class _Run:
    """The shared state of one apply: results, failures, and a condition the caller waits on."""

    def __init__(self, replicas: Sequence[nn.Module]) -> None:
        self.replicas = replicas
        self.results: list[Any] = [None] * len(replicas)
        self.failures: list[tuple[int, torch.device | None, BaseException]] = []
        self.remaining = len(replicas)
        self.aborted = False
        self.cond = threading.Condition()

    def finish(self, index: int, output: Any) -> None:
        with self.cond:
            self.results[index] = output
            self.remaining -= 1
            self.cond.notify_all()

    def fail(self, index: int, device: torch.device | None, exc: BaseException) -> None:
        # Record before aborting: the abort makes peers fail too, and their echoes must come after this error.
        with self.cond:
            self.failures.append((index, device, exc))
        self.abort(exc)
        with self.cond:
            self.remaining -= 1
            self.cond.notify_all()

    def abort(self, exc: BaseException) -> None:
        with self.cond:
            first, self.aborted = not self.aborted, True
        if first:
            abort_replicas(self.replicas, exc)


def _call(module: nn.Module, inputs: Any, kwargs: dict[str, Any]) -> Any:
    if not isinstance(inputs, (list, tuple)):
        inputs = (inputs,)
    return module(*inputs, **kwargs)


def _work(
    run: _Run,
    index: int,
    inputs: Any,
    kwargs: dict[str, Any],
    device: torch.device | None,
    stream: torch.cuda.Stream | None,
    state: _threadstate.ThreadState,
) -> tuple[bool, Any]:
    """Run replica ``index``: ``(True, output)``, or ``(False, exc)`` for anything it raised."""
    try:
        with _threadstate.cuda_context(device, stream), state.enter():
            return True, _call(run.replicas[index], inputs, kwargs)
    except BaseException as exc:  # a worker must never die silently: everything goes back to the caller
        return False, exc


def _report(run: _Run, index: int, device: torch.device | None, outcome: tuple[bool, Any]) -> None:
    ok, value = outcome
    if ok:
        run.finish(index, value)
    else:
        run.fail(index, device, value)


def _run_task(work: Callable[[], tuple[bool, Any]], report: Callable[[tuple[bool, Any]], None]) -> None:
    report(work())


def _raise_first(run: _Run) -> None:
    with run.cond:
        failures = list(run.failures)
    primary = [failure for failure in failures if not _is_secondary(failure[2])] or failures
    index, device, exc = primary[0]
    raise _annotate(exc, index, device)


def apply_replicas(
    replicas: Sequence[nn.Module],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[dict[str, Any]] | None = None,
    devices: Sequence[torch.device | None] | None = None,
    *,
    abort_join_timeout: float = ABORT_JOIN_TIMEOUT,
    threads: ReplicaThreads | None = None,
) -> list[Any]:
    """Call ``replicas[i](*inputs[i], **kwargs_tup[i])`` in parallel threads and return the outputs in order.

    A single replica runs in the caller's thread. The wait for the replicas lasts as long as they run (as a
    direct call would), but ends as soon as one of them raises: the failure aborts the others (see module
    docstring), which get ``abort_join_timeout`` seconds to finish, and the first primary error is re-raised
    as the original object with a note naming its replica and device.

    What ends the wait: every replica's end, including every failure (a worker catches everything, so a
    replica never ends without waking the caller); a replica blocked in a synchronisation whose peer failed is
    released by the abort; one blocked for another reason is ended by that synchronisation's own timeout
    (pc-sync: ``sync_timeout``). The wait itself adds no timeout: user code may legitimately run long.

    Args:
        replicas: one module per replica.
        inputs: per-replica positional inputs (a tuple/list of arguments, or a single argument).
        kwargs_tup: per-replica keyword inputs; ``{}`` each when omitted.
        devices: per-replica devices (CUDA devices are entered in the worker); ``None`` each when omitted.
        abort_join_timeout: seconds to wait for the other replicas after a failure.
        threads: the :class:`~pc_replicate._pool.ReplicaThreads` to run the replicas on (kept between calls);
            ``None`` starts a thread per replica for this call.

    Returns:
        The outputs, in replica order.

    Raises:
        ValueError: if the argument lengths differ.
        BaseException: the first error raised by a replica (its original type), or a ``KeyboardInterrupt``
            received while waiting (after aborting the replicas).
    """
    count = len(replicas)
    kwargs_list = list(kwargs_tup) if kwargs_tup is not None else [{} for _ in range(count)]
    device_list = list(devices) if devices is not None else [None] * count
    if not len(inputs) == len(kwargs_list) == len(device_list) == count:
        raise ValueError(
            f"got {count} replicas, {len(inputs)} inputs, {len(kwargs_list)} kwargs and {len(device_list)} "
            "devices; expected one of each per replica"
        )
    run = _Run(replicas)
    state = _threadstate.capture()
    streams = [_threadstate.current_stream(device) for device in device_list]
    tasks = [
        (
            functools.partial(_work, run, index, inputs[index], kwargs_list[index], device, stream, state),
            functools.partial(_report, run, index, device),
        )
        for index, (device, stream) in enumerate(zip(device_list, streams, strict=True))
    ]
    if count == 1:
        _run_task(*tasks[0])
    else:
        for index, task in enumerate(tasks):
            if threads is not None:
                threads.submit(*task)
            else:
                name = f"pc-replicate-replica-{index}"
                threading.Thread(target=_run_task, args=task, name=name, daemon=True).start()
        _wait(run, abort_join_timeout)
    if run.failures:
        _raise_first(run)
    return run.results


def _wait(run: _Run, abort_join_timeout: float) -> None:
    try:
        with run.cond:
            # No timeout while every replica is healthy: they run user code for as long as it takes.
            while run.remaining and not run.failures:
                run.cond.wait()
            deadline = time.monotonic() + abort_join_timeout
            while run.remaining:
                left = deadline - time.monotonic()
                if left <= 0 or not run.cond.wait(left):
                    break
            if run.remaining:
                logger.warning(
                    "%d replica(s) still running %.1f s after replica %d failed; re-raising without them",
                    run.remaining,
                    abort_join_timeout,
                    run.failures[0][0],
                )
    except BaseException as exc:  # Ctrl-C while waiting: release peers blocked in a sync, then propagate
        run.abort(exc)
        raise
