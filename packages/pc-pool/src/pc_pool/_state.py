"""The one state object of a process pool, shared by the callers, the feeder and the result thread.

:class:`EngineState` owns the job table, the ready deques, the worker handles and the lifecycle state, all
guarded by its condition ``cond``; the feeder (:mod:`pc_pool._feeder`), the result thread
(:mod:`pc_pool._collector`) and the worker set (:mod:`pc_pool._workers`) are each given a reference to it and
change it only through its fields under ``cond`` or through its methods. :class:`Wakeup` is the self-pipe that
wakes the result thread out of its ``wait``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
from collections.abc import Iterable
from typing import Any

from pc_pool._records import Chunk, Job, WorkerHandle
from pc_pool._settings import PoolStates
from pc_pool.errors import PoolTerminatedError

__all__ = ["EngineState", "Wakeup"]

_log = logging.getLogger(__name__)


class Wakeup:
    """A non-blocking self-pipe: :meth:`wake` makes ``fileno`` readable for the result thread's ``wait``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    @property
    def fileno(self) -> int:
        """The read end (to ``wait`` on)."""
        return self._r

    def wake(self) -> None:
        """Make the read end readable (a full pipe already is; after :meth:`close` nobody is woken)."""
        with self._lock, contextlib.suppress(BlockingIOError, OSError):
            if self._w >= 0:
                os.write(self._w, b"\0")

    def drain(self) -> None:
        """Consume every pending wake-up."""
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        """Close both ends; later :meth:`wake` calls do nothing (never write to a reused fd number)."""
        with self._lock:
            for fd in (self._r, self._w):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._r = self._w = -1


class EngineState:
    """Jobs, ready chunks, worker handles and the lifecycle of one process pool.

    Every field is guarded by ``cond`` unless noted. Callers add work with :meth:`submit`; the feeder takes
    chunks from ``ready``/``slot_ready``; the result thread completes them with :meth:`deliver`; anyone may
    end the pool with :meth:`fail_everything` or :meth:`break_pool`.

    Args:
        processes: Number of worker indices.
        p2p: Pin chunk k to worker ``k % processes`` (``P2PPool``) instead of one shared deque.
    """

    def __init__(self, processes: int, *, p2p: bool) -> None:
        self.processes = processes
        self.p2p = p2p
        self.state = PoolStates.RUN
        self.cond = threading.Condition(threading.Lock())
        self.cache: dict[int, Any] = {}  # result handles by job id (filled and emptied by the handles)
        self.jobs: dict[int, Job] = {}
        self.workers: list[WorkerHandle | None] = [None] * processes
        self.ready: collections.deque[Chunk] = collections.deque()
        self.slot_ready: list[collections.deque[Chunk]] = [collections.deque() for _ in range(processes)]
        self.stopping = False  # the result thread is (or must be) shutting down
        self.broken: BaseException | None = None  # why the pool broke (set once)
        self.chunk_counter = 0
        self.wakeup = Wakeup()

    def reset_queues(self) -> None:
        """Create empty ready deques and a fresh wakeup pipe (the ``setup_queues`` hook)."""
        old = self.wakeup
        self.ready = collections.deque()
        self.slot_ready = [collections.deque() for _ in range(self.processes)]
        self.wakeup = Wakeup()
        old.close()

    # -- callers ---------------------------------------------------------------------------------------------
    def check_running(self) -> None:
        """Raise ``ValueError("Pool not running...")`` unless the pool accepts work."""
        if self.state is not PoolStates.RUN:
            if self.broken is not None:
                raise ValueError(f"Pool not running: it broke because {self.broken!r}") from self.broken
            raise ValueError("Pool not running")

    def submit(self, job: Job, chunks: list[list[Any]]) -> None:
        """Register ``job`` and queue its chunks (pinned round-robin to worker indices when ``p2p``)."""
        with self.cond:
            self.check_running()
            self.jobs[job.id] = job
            for index, items in enumerate(chunks):
                self._queue(job, index, items)
            self.cond.notify_all()

    def _queue(self, job: Job, index: int, items: list[Any]) -> None:
        if self.p2p:
            slot = self.chunk_counter % self.processes
            self.chunk_counter += 1
            self.slot_ready[slot].append(Chunk(job, index, items, slot))
        else:
            self.ready.append(Chunk(job, index, items))

    def open_job(self, job: Job) -> None:
        """Register ``job`` with no chunks yet (they come through :meth:`add_chunk`, from an input thread)."""
        with self.cond:
            self.check_running()
            self.jobs[job.id] = job

    def add_chunk(self, job: Job, index: int, items: list[Any]) -> bool:
        """Queue chunk ``index`` of an open job; False if the job is gone (the pool terminated or broke)."""
        with self.cond:
            if job.id not in self.jobs or self.state is PoolStates.TERMINATE:
                return False
            self._queue(job, index, items)
            self.cond.notify_all()
            return True

    def drop_job(self, job: Job) -> None:
        """Drop a complete job whose last result arrived before its input ended."""
        with self.cond:
            if self.jobs.pop(job.id, None) is not None:
                self.cond.notify_all()
        if self.state is PoolStates.CLOSE:
            self.wake()

    def submit_direct(self, job: Job, items: list[Any]) -> tuple[WorkerHandle, Chunk] | None:
        """Register a one-chunk ``job``; hand its chunk to an idle worker claimed for the caller, if any.

        An idle worker (nothing outstanding, so its task pipe is empty) is marked ``direct`` (its feeder keeps
        off) and returned with the chunk, already in its ``outstanding``: the caller sends it itself, one
        thread hop fewer, and must call :meth:`end_direct`. Without an idle worker (or with chunks waiting)
        the chunk is queued for the feeders as by :meth:`submit` and ``None`` is returned.
        """
        with self.cond:
            self.check_running()
            self.jobs[job.id] = job
            chunk = Chunk(job, 0, items)
            if not self.ready:
                for w in self.workers:
                    if (
                        w is not None
                        and not w.outstanding
                        and not (w.dead or w.direct or w.exit_sent or w.retiring)
                    ):
                        w.direct = True
                        w.outstanding.append(chunk)
                        return w, chunk
            self.ready.append(chunk)
            self.cond.notify_all()
            return None

    def end_direct(self, w: WorkerHandle) -> None:
        """The caller that claimed ``w`` in :meth:`submit_direct` is done sending: its feeder may go on."""
        with self.cond:
            w.direct = False
            if self.ready or self.slot_ready[w.index] or w.retiring or self.state is not PoolStates.RUN:
                self.cond.notify_all()

    # -- pool threads ----------------------------------------------------------------------------------------
    def wake(self) -> None:
        """Wake the result thread out of its wait."""
        self.wakeup.wake()

    def wants_workers(self) -> bool:
        """Whether missing workers should be started (running, or closed with work left)."""
        if self.stopping or self.state is PoolStates.TERMINATE:
            return False
        return self.state is PoolStates.RUN or bool(self.jobs)

    def requeue(self, chunks: Iterable[Chunk]) -> None:
        """Put chunks back at the front, in their order (the caller holds ``cond``)."""
        for chunk in reversed(list(chunks)):
            chunk.sent = False
            chunk.sent_payloads = ()  # released by the caller (or by the worker that drains them) if needed
            if chunk.job.id not in self.jobs:
                continue
            (self.slot_ready[chunk.slot] if chunk.slot is not None else self.ready).appendleft(chunk)
        self.cond.notify_all()

    def deliver(self, chunk: Chunk, success: bool, value: Any) -> None:
        """Complete ``chunk`` of its job (a list of values, or an exception); drop the job once it is done."""
        job = chunk.job
        if job.result._set(chunk.index, success, value):
            with self.cond:
                if self.jobs.pop(job.id, None) is not None:
                    self.cond.notify_all()
            if self.state is PoolStates.CLOSE:
                self.wake()

    # -- ending ----------------------------------------------------------------------------------------------
    def fail_everything(self, exc: BaseException) -> None:
        """Move to TERMINATE, drop every pending chunk, fail every pending result with a copy of ``exc``."""
        with self.cond:
            self.state = PoolStates.TERMINATE
            self.stopping = True
            jobs = list(self.jobs.values())
            self.jobs.clear()
            self.ready.clear()
            for dq in self.slot_ready:
                dq.clear()
            self.cond.notify_all()
        for job in jobs:
            err = type(exc)(*exc.args)
            err.__cause__ = exc.__cause__
            job.result._fail(err)
        self.wake()

    def break_pool(self, cause: BaseException, what: str) -> None:
        """The pool cannot go on (``what`` happened, because of ``cause``): TERMINATE with that cause.

        Every pending result fails with :class:`~pc_pool.PoolTerminatedError` ``"the pool broke: <what>"``
        whose ``__cause__`` is ``cause``; new calls raise ``ValueError("Pool not running: it broke ...")``.
        """
        with self.cond:
            if self.broken is not None:
                return  # already broken: the first cause stands, everything pending has failed
            self.broken = cause
        _log.error("pc_pool: %s; terminating the pool: %r", what, cause)
        err = PoolTerminatedError(f"the pool broke: {what} ({cause!r})")
        err.__cause__ = cause
        self.fail_everything(err)
