"""The feeder threads of the process pool: one per worker index, the only writer of that worker's task pipe.

A feeder waits (under ``_cond``) until its worker has fewer than ``WINDOW`` chunks outstanding
(``FAST_WINDOW`` while the worker answers fast) and a chunk is ready, serializes the chunk *at dispatch*
(memory stays bounded; share handles are made only for chunks that leave), and sends it. A pickling error
fails that chunk alone. It also sends the exit request to a retiring worker, or to every worker once a closed
pool has drained.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import types

from pc_pool import _serial
from pc_pool._engine import (
    FAST_WINDOW,
    TICK,
    WINDOW,
    EngineState,
    PoolStates,
    block_sigint_in_this_thread,
    now,
)
from pc_pool._protocol import EXIT
from pc_pool._records import Chunk, Job, WorkerHandle

__all__ = ["FeederMixin"]

_FUNC_CACHE_SIZE = 64


class FeederMixin(EngineState):
    """The feeder side of :class:`~pc_pool.BasePool`."""

    _func_cache: collections.OrderedDict[int, tuple[object, bytes]]
    _func_cache_lock: threading.Lock

    def _init_feeder(self) -> None:
        self._func_cache = collections.OrderedDict()
        self._func_cache_lock = threading.Lock()

    def _next_action(self, index: int) -> tuple[WorkerHandle, Chunk | None] | None:
        """Under ``_cond``: wait for something for worker ``index`` to do; ``None`` means the feeder exits."""
        while True:
            if self._stopping:
                return None
            w = self._workers[index]
            if w is not None and not w.dead and not w.exit_sent:
                if w.retiring or (self._state is PoolStates.CLOSE and not self._jobs):
                    w.exit_sent = True
                    return w, None
                if len(w.outstanding) < (FAST_WINDOW if w.fast else WINDOW):
                    dq = self._slot_ready[index] if self._slot_ready[index] else self._ready
                    if dq:
                        chunk = dq.popleft()
                        w.outstanding.append(chunk)
                        return w, chunk
            self._cond.wait(TICK)

    def _feed(self, index: int) -> None:
        block_sigint_in_this_thread()  # Ctrl-C must reach the main thread (see the function's docstring)
        while True:
            with self._cond:
                action = self._next_action(index)
            if action is None:
                return
            w, chunk = action
            del action
            if chunk is None:
                with w.send_lock:
                    if not w.dead:
                        with contextlib.suppress(OSError):
                            w.task_conn.send_bytes(EXIT)
            else:
                self._send_chunk(w, chunk)
            # Drop our references before waiting: a chunk holds the caller's arguments (shared tensors, fds).
            del w, chunk

    def _dump_func(self, w: WorkerHandle, job: Job) -> bytes | None:
        if job.id in w.sent_jobs:
            return None
        if not self._copy_tensor:  # share handles are one-shot: one dump per worker and job
            return _serial.dumps(job.func, recurse=self._recurse, copy_tensor=False)
        cached = self._cached_func_blob(job.func)
        if cached is not None:
            return cached
        with job.lock:
            if job.func_error is not None:
                raise job.func_error
            if job.func_blob is None:
                try:
                    job.func_blob = _serial.dumps(job.func, recurse=self._recurse, copy_tensor=True)
                except Exception as exc:
                    job.func_error = exc
                    raise
                self._remember_func_blob(job.func, job.func_blob)
            return job.func_blob

    # A plain function without a closure pickles to the same bytes every time (with recurse=False its globals
    # are looked up in the worker), so repeated applies of one function reuse its payload instead of paying
    # the dill path per job. Closures, callables with state and is_recursive pools are dumped per job.
    def _cached_func_blob(self, func: object) -> bytes | None:
        with self._func_cache_lock:
            entry = self._func_cache.get(id(func))
            if entry is not None and entry[0] is func:
                self._func_cache.move_to_end(id(func))
                return entry[1]
        return None

    def _remember_func_blob(self, func: object, blob: bytes) -> None:
        if self._recurse or not isinstance(func, types.FunctionType) or func.__closure__ is not None:
            return
        with self._func_cache_lock:
            self._func_cache[id(func)] = (func, blob)  # holding func keeps its id from being reused
            while len(self._func_cache) > _FUNC_CACHE_SIZE:
                self._func_cache.popitem(last=False)

    def _send_chunk(self, w: WorkerHandle, chunk: Chunk) -> None:
        job = chunk.job
        try:
            func_blob = self._dump_func(w, job)
            payload = _serial.dumps(chunk.items, recurse=self._recurse, copy_tensor=self._copy_tensor)
        except Exception as exc:
            with self._cond:
                try:
                    w.outstanding.remove(chunk)
                except ValueError:
                    return  # the worker died meanwhile and its reaper already took the chunk back
                self._cond.notify_all()
            self._deliver(chunk, False, exc)
            return
        # Only this feeder touches w.sent_jobs; a job leaving _jobs concurrently is dropped on the next chunk.
        drops = tuple(j for j in w.sent_jobs if j not in self._jobs)
        header = (job.id, chunk.index, job.mode, func_blob, drops)
        with w.send_lock:
            if w.dead:
                return
            try:
                chunk.sent_at = now()
                chunk.nbytes = self.pool_inqueue_put((w.index, header, payload))
            except OSError:
                return  # the worker died; its reaper re-dispatches the unsent chunk
            chunk.sent = True
            w.sent_jobs.add(job.id)
            w.sent_jobs.difference_update(drops)
