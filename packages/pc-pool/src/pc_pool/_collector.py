"""The result thread of the process pool: starts every worker, reads the result pipes, reaps dead workers.

It blocks in ``multiprocessing.connection.wait`` on the result pipes, the worker sentinels and a wakeup pipe
(through ``pool_outqueue_get``). When a sentinel fires it drains that worker's pipe, fails the first
unanswered chunk (the one that was running) with :class:`~pc_pool.WorkerDiedError`, puts the rest back and
starts a replacement at the same index. It also starts the initial workers, so ``PR_SET_PDEATHSIG``
(which follows the forking *thread*) fires only when the pool itself is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

from pc_pool import _serial
from pc_pool._engine import (
    CLOSE_GRACE,
    FAST_RTT,
    NO_CONTEXT,
    TICK,
    EngineState,
    PoolStates,
    block_sigint_in_this_thread,
    now,
)
from pc_pool._protocol import (
    K_ENC,
    K_ERR,
    K_INIT_ERR,
    K_OK,
    K_READY,
    K_RETIRE,
    RESULT_ACK,
    MaybeEncodingError,
    recv_msg,
    unread_bytes,
)
from pc_pool._quiet import quiet_numpy_warning_in_children
from pc_pool._records import Chunk, WorkerHandle
from pc_pool.errors import PoolTerminatedError, RemoteTraceback, WorkerDiedError
from pc_pool.worker import worker_main

__all__ = ["CollectorMixin"]

_log = logging.getLogger("pc_pool.pool")
_MAX_UNREADY_DEATHS = 3  # consecutive deaths before "ready" that break the pool


class CollectorMixin(EngineState):
    """The result-thread side of :class:`~pc_pool.BasePool`."""

    _unready_deaths = 0

    def _result_loop(self) -> None:
        # Workers are forked from this thread and inherit its signal mask: with SIGINT blocked here, a Ctrl-C
        # that lands between fork and the worker's SIG_IGN stays pending and is then discarded, instead of
        # raising KeyboardInterrupt inside a half-started worker. The main thread still receives Ctrl-C.
        block_sigint_in_this_thread()
        try:
            self.repopulate_pool()
        except BaseException as exc:
            self._start_error = exc
            self._stopping = True
        finally:
            self._started.set()
        try:
            while not self._stopping:
                try:
                    events = self.pool_outqueue_get(TICK)
                except TimeoutError:
                    events = []
                    self.maintain_pool()  # backstop only: sentinels report deaths
                except OSError:
                    break
                for index, event in events:
                    w = self._workers[index]
                    if w is None or w.dead:
                        continue
                    if event is None:
                        self._reap(w)
                    else:
                        self._handle_reply(w, *event)
                self._check_closed()
        except BaseException:  # pragma: no cover - a bug here must not leave callers hanging
            _log.exception("pc_pool result thread crashed; terminating the pool")
            self._fail_everything(PoolTerminatedError("the pool's result thread crashed"))
        finally:
            self._shutdown_workers()

    def _check_closed(self) -> None:
        """After a drained ``close()``: exit once every worker is gone (killing stragglers after a grace)."""
        if self._state is not PoolStates.CLOSE or self._jobs:
            return
        with self._cond:
            self._cond.notify_all()  # feeders send EXIT
        if all(w is None for w in self._workers):
            self._stopping = True
            return
        if self._close_deadline is None:
            self._close_deadline = now() + CLOSE_GRACE
        elif now() > self._close_deadline:
            self.terminate_workers()

    def _shutdown_workers(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self.terminate_workers()
        self.join_workers()
        for w in self._workers:
            if w is not None:
                self._close_handle(w)
        with self._wake_lock:  # _wake() must never write to a closed (and maybe reused) fd number
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._wake_w = -1

    def _close_handle(self, w: WorkerHandle) -> None:
        w.dead = True
        if w.send_lock.acquire(timeout=TICK):
            try:
                w.task_conn.close()
            finally:
                w.send_lock.release()
        w.result_conn.close()
        try:
            w.process.close()
        except ValueError:  # pragma: no cover - still running after kill + join
            _log.warning("pool worker pid %s did not exit", w.process.pid)

    def _start_worker(self, index: int) -> WorkerHandle:
        task_r, task_w = self._ctx.Pipe(duplex=False)
        # Share mode: duplex, so the parent can acknowledge each result it loaded (see worker.ResultPutter).
        result_r, result_w = self._ctx.Pipe(duplex=not self._copy_tensor)
        try:
            context = self._worker_context(index)
            has_ctx = context is not NO_CONTEXT
            init_blob = _serial.dumps(
                (self._initializer, self._initargs, has_ctx, context if has_ctx else None),
                recurse=self._recurse,
                copy_tensor=self._copy_tensor,
            )
            process = self._ctx.Process(  # type: ignore[attr-defined]
                target=worker_main,
                args=(
                    type(self).worker,
                    task_r,
                    result_w,
                    init_blob,
                    self._copy_tensor,
                    self._maxtasksperchild,
                    os.getpid(),
                ),
                name=f"pc_pool-worker-{index}",
                daemon=self._daemon,
            )
            with quiet_numpy_warning_in_children():  # spawned workers start with that -W option
                process.start()
        except BaseException:
            for conn in (task_r, task_w, result_r, result_w):
                conn.close()
            raise
        task_r.close()
        result_w.close()
        return WorkerHandle(index, process, task_w, result_r)

    def _handle_reply(self, w: WorkerHandle, header: tuple[Any, ...], blob: bytes | None) -> None:
        kind, job_id, chunk_index, text = header
        if kind == K_READY:
            w.ready = True
            self._unready_deaths = 0
            return
        if kind == K_RETIRE:
            with self._cond:
                w.retiring = True
                self._requeue(w.outstanding)
                w.outstanding.clear()
            return
        if kind == K_INIT_ERR:
            self._break(_load_exception(blob, text))
            return
        with self._cond:
            chunk = w.outstanding.popleft() if w.outstanding else None
            w.answered += 1
            w.fast = chunk is not None and now() - chunk.sent_at < FAST_RTT
            self._cond.notify_all()
        if chunk is None or chunk.job.id != job_id or chunk.index != chunk_index:  # pragma: no cover
            self._ack(w, kind)
            _log.error(
                "pc_pool: unexpected reply for job %s chunk %s from worker %s", job_id, chunk_index, w.index
            )
            return
        if kind == K_OK:
            try:
                values = _serial.loads(blob) if blob is not None else None
            except Exception as exc:
                self._ack(w, kind)
                self._deliver(chunk, False, exc)
                return
            self._ack(w, kind)
            self._deliver(chunk, True, values)
        elif kind in (K_ERR, K_ENC):
            self._deliver(chunk, False, _load_exception(blob, text))

    def _ack(self, w: WorkerHandle, kind: int) -> None:
        """Share mode: tell the worker its result is loaded (its fds fetched), so it may run the next chunk.

        Without this, a worker could crash in its next chunk before this thread loaded the result it had
        sent, and that finished result would fail too (its fds are fetched from the worker).
        """
        if kind == K_OK and not self._copy_tensor:
            with contextlib.suppress(OSError):  # a dead worker: its reaper is draining what it sent
                w.result_conn.send_bytes(RESULT_ACK)

    def _reap(self, w: WorkerHandle) -> None:
        """Worker ``w``'s process ended: read what it left, fail its running chunk, start a replacement."""
        try:
            while True:
                msg = recv_msg(w.result_conn)
                if msg is not None:
                    self._handle_reply(w, *msg)
        except (EOFError, OSError):
            pass
        w.process.join(TICK)
        exitcode, pid = w.process.exitcode, w.process.pid
        # A feeder mid-send to the dead worker gets EPIPE and lets go of send_lock.
        with w.send_lock, self._cond:
            w.dead = True
            chunks = list(w.outstanding)
            w.outstanding.clear()
            crashed = not w.retiring and not w.exit_sent and not self._stopping
            died = _running_chunk(chunks, unread_bytes(w.task_conn)) if crashed else None
            if died is not None:
                chunks.remove(died)
            self._requeue(chunks)
            self._workers[w.index] = None
        self._close_handle(w)
        if crashed and not w.ready:
            # Died before it was ready: killed during start-up, or an initializer that exits or crashes. Only
            # a run of such deaths with no ready worker in between breaks the pool (no respawn loop).
            self._unready_deaths += 1
            if self._unready_deaths >= _MAX_UNREADY_DEATHS:
                self._break(WorkerDiedError(pid, exitcode))
                return
        if crashed:
            _log.warning(
                "pc_pool worker %s (pid %s) died with exit code %s; replacing it", w.index, pid, exitcode
            )
        self.repopulate_pool()
        if died is not None:
            self._deliver(died, False, WorkerDiedError(pid, exitcode))

    def _deliver(self, chunk: Chunk, success: bool, value: Any) -> None:
        job = chunk.job
        if job.result._set(chunk.index, success, value):
            with self._cond:
                if self._jobs.pop(job.id, None) is not None:
                    self._cond.notify_all()
            if self._state is PoolStates.CLOSE:
                self._wake()


def _running_chunk(chunks: list[Chunk], unread: int | None) -> Chunk | None:
    """The chunk a dead worker was running: the last sent one whose bytes it had started to read.

    Chunks are sent in order and the worker reads one at a time, so the sent chunks whose bytes are all still
    in the pipe (``unread``, from FIONREAD) never started and are re-dispatched. Without FIONREAD the first
    sent chunk is assumed to be running.
    """
    sent = [c for c in chunks if c.sent]
    if not sent:
        return None
    if unread is None:
        return sent[0]
    started = len(sent)
    for chunk in reversed(sent):
        if unread < chunk.nbytes:
            break
        unread -= chunk.nbytes
        started -= 1
    return sent[started - 1] if started > 0 else None


def _load_exception(blob: bytes | None, tb: str | None) -> BaseException:
    """Rebuild a worker's exception with its remote traceback as ``__cause__``."""
    try:
        exc = _serial.loads(blob) if blob is not None else RuntimeError("worker sent no exception")
        if not isinstance(exc, BaseException):
            raise TypeError(f"expected an exception, got {type(exc).__name__}")
    except Exception as load_exc:
        exc = MaybeEncodingError(load_exc, "<the worker's exception>")
    if tb:
        exc.__cause__ = RemoteTraceback(tb)
    return exc
