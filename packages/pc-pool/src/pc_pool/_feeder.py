"""The feeder of the process pool: one thread per worker index, the only writer of that worker's task pipe.

Feeder thread i waits (under the engine's ``cond``) until worker i is down to half its window of outstanding
chunks (2, deeper while it answers fast) and chunks are ready, serializes them *at dispatch*
(memory stays bounded; share handles are made only for chunks that leave), and sends it through the pool's
``pool_inqueue_put`` hook. A pickling error fails that chunk alone. It also sends the exit request to a
retiring worker, or to every worker once a closed pool has drained.

:class:`Feeder` holds explicit references to what it needs: the :class:`~pc_pool._state.EngineState` and the
``send`` callable; it owns the function-payload cache.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any

from pc_pool import _serial
from pc_pool._func_payloads import FunctionPayloads
from pc_pool._protocol import EXIT
from pc_pool._records import Chunk, Job, WorkerHandle
from pc_pool._settings import TICK, PoolStates, now
from pc_pool._signals import start_with_sigint_blocked
from pc_pool._state import EngineState

__all__ = ["Feeder"]


class Feeder:
    """The feeder threads of one pool.

    Args:
        state: The pool's engine state.
        send: Writes ``(worker_index, header, payload)`` to that worker's task pipe and returns the bytes
            written (the pool's ``pool_inqueue_put`` hook).
        copy_tensor: Copy tensors into payloads (``False``: share them).
        recurse: Carry the globals of by-value functions by value.
        send_batch: Writes several messages to one worker at once and returns the sizes of those that went
            out whole (``WorkerSet.send_batch``); ``None`` (the pool overrides ``pool_inqueue_put``): ``send``
            per message.
    """

    def __init__(
        self,
        state: EngineState,
        send: Callable[[tuple[int, tuple[Any, ...], bytes]], int],
        *,
        copy_tensor: bool,
        recurse: bool,
        send_batch: Callable[[int, list[tuple[tuple[Any, ...], bytes]]], list[int]] | None = None,
    ) -> None:
        self._state = state
        self._send_batch = send_batch
        self._copy_tensor = copy_tensor
        self._recurse = recurse
        # The payloads of functions that nothing mutable travels with, reused while nothing in them changed.
        # They hold no tensor, so copy mode changes nothing in them and makes them valid for any worker. (A
        # partial, not a bound method: no cycle through self keeps a finished pool's functions alive.)
        self._payloads = FunctionPayloads(
            functools.partial(_serial.dumps, recurse=recurse, copy_tensor=True), recurse
        )
        self._threads = [
            # send (bound to the pool) rides in the thread's arguments, dropped when the thread ends: no
            # reference cycle keeps a finished pool alive.
            threading.Thread(target=self._feed, args=(i, send), name=f"pc_pool-feeder-{i}", daemon=True)
            for i in range(state.processes)
        ]

    def start(self) -> None:
        """Start one feeder thread per worker index."""
        for thread in self._threads:
            start_with_sigint_blocked(thread)  # Ctrl-C must reach the main thread

    def join(self, timeout: float) -> None:
        """Wake the feeders and wait up to ``timeout`` seconds for each to exit (they exit once stopping)."""
        with self._state.cond:
            self._state.cond.notify_all()
        for thread in self._threads:
            if thread.ident is not None and thread is not threading.current_thread():
                thread.join(timeout)

    # -- the thread ------------------------------------------------------------------------------------------
    def _next_action(self, index: int) -> tuple[WorkerHandle, list[Chunk] | None] | None:
        """Under ``cond``: wait for something for worker ``index`` to do; ``None`` means the feeder exits.

        Chunks are taken in batches: once worker ``index`` is down to ``refill`` outstanding chunks, as many
        as fit in its window are taken at once (and written with one system call), so a stream of tiny tasks
        wakes the feeder once per few answers instead of once per answer.
        """
        st = self._state
        while True:
            if st.stopping:
                return None
            w = st.workers[index]
            if w is not None and not w.dead and not w.exit_sent and not w.direct:
                if w.retiring or (st.state is PoolStates.CLOSE and not st.jobs):
                    w.exit_sent = True
                    return w, None
                if len(w.outstanding) <= w.refill:
                    taken: list[Chunk] = []
                    while len(w.outstanding) < w.window:
                        dq = st.slot_ready[index] if st.slot_ready[index] else st.ready
                        if not dq:
                            break
                        chunk = dq.popleft()
                        w.outstanding.append(chunk)
                        taken.append(chunk)
                    if taken:
                        return w, taken
            # Woken by submit, deliver, a new worker, an answer that reaches the refill level and shutdown;
            # TICK is only a backstop (the tests raise it to an hour to prove that nothing relies on it).
            st.cond.wait(TICK)

    def _feed(self, index: int, send: Callable[[tuple[int, tuple[Any, ...], bytes]], int]) -> None:
        while True:
            with self._state.cond:
                action = self._next_action(index)
            if action is None:
                return
            w, chunks = action
            del action
            if chunks is None:
                with w.send_lock:
                    if not w.dead:
                        with contextlib.suppress(OSError):
                            w.task_conn.send_bytes(EXIT)
            else:
                self.send_chunks(w, chunks, send)
            # Drop our references before waiting: a chunk holds the caller's arguments (shared tensors, fds).
            del w, chunks

    # -- payloads --------------------------------------------------------------------------------------------
    def _dump_func(self, w: WorkerHandle, job: Job) -> bytes | None:
        if job.id in w.sent_jobs:
            return None
        if not self._copy_tensor:
            # A payload the cache can hold carries no tensor (see _func_payloads), so one dump serves every
            # worker and job; any other carries one-shot share handles: one dump per worker and job.
            blob = self._payloads.payload(job.func)
            if blob is not None:
                return blob
            return _serial.dumps(job.func, recurse=self._recurse, copy_tensor=False)
        with job.lock:
            if job.func_error is not None:
                raise job.func_error
            if job.func_blob is None:
                try:
                    blob = self._payloads.payload(job.func)
                    if blob is None:  # not cached: once per job, for every worker
                        blob = _serial.dumps(job.func, recurse=self._recurse, copy_tensor=True)
                    job.func_blob = blob
                except Exception as exc:
                    job.func_error = exc
                    raise
            return job.func_blob

    def send_chunks(
        self,
        w: WorkerHandle,
        chunks: list[Chunk],
        send: Callable[[tuple[int, tuple[Any, ...], bytes]], int],
    ) -> None:
        """Serialize ``chunks`` (already appended to ``w.outstanding``, in order) and send them to ``w``.

        Called by feeder ``w.index``, or by a caller thread that claimed the idle worker ``w`` (``w.direct``):
        one thread at a time per worker, so the pipe order is the order of ``w.outstanding``. A chunk that
        cannot be pickled fails alone.
        """
        st = self._state
        messages: list[tuple[tuple[Any, ...], bytes]] = []
        ready: list[tuple[Chunk, bytes | None, bytes]] = []
        batch_jobs: set[int] = set()
        for chunk in chunks:
            job = chunk.job
            func_blob: bytes | None = None
            try:
                if job.id not in batch_jobs:
                    func_blob = self._dump_func(w, job)
                payload = _serial.dumps(chunk.items, recurse=self._recurse, copy_tensor=self._copy_tensor)
            except Exception as exc:
                if not self._copy_tensor:
                    _serial.release(func_blob)  # dumped for this chunk, never sent
                with st.cond:
                    try:
                        w.outstanding.remove(chunk)
                    except ValueError:
                        continue  # the worker died meanwhile and its reaper already took the chunk back
                    st.cond.notify_all()
                st.deliver(chunk, False, exc)
                continue
            if func_blob is not None:
                batch_jobs.add(job.id)
            ready.append((chunk, func_blob, payload))
        if not ready:
            return
        # Only this thread touches w.sent_jobs; a job leaving jobs concurrently is dropped on the next chunk.
        drops = tuple(j for j in w.sent_jobs if j not in st.jobs)
        for chunk, func_blob, payload in ready:
            messages.append(((chunk.job.id, chunk.index, chunk.job.mode, func_blob, drops), payload))
            drops = ()
        with w.send_lock:
            sizes: list[int] = []
            try:
                if not w.dead:
                    sent_at = now()
                    if self._send_batch is not None:
                        sizes = self._send_batch(w.index, messages)
                    else:
                        for header, payload in messages:
                            sizes.append(send((w.index, header, payload)))
            except OSError:
                pass  # the worker died; its reaper re-dispatches the unsent chunks
            sent, unsent = ready[: len(sizes)], ready[len(sizes) :]
            if unsent and not self._copy_tensor:  # share handles nobody will load: give them back now
                _serial.release_all((func_blob, payload) for _, func_blob, payload in unsent)
            if not sent:
                return
            with st.cond:  # (lock order: send_lock, then cond, as the reaper takes them)
                # A retiring worker's chunks are put back while we send: the worker drains this copy unread
                # (releasing its arguments) and the chunk's fields now belong to its next dispatch.
                for (chunk, func_blob, payload), size in zip(sent, sizes, strict=True):
                    if any(c is chunk for c in w.outstanding):
                        chunk.sent_at = sent_at
                        chunk.nbytes = size
                        chunk.sent = True
                        if not self._copy_tensor:
                            chunk.sent_payloads = (func_blob, payload)
            w.sent_jobs.update(chunk.job.id for chunk, _, _ in sent)
            w.sent_jobs.difference_update(messages[0][0][4])
