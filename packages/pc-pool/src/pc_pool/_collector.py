"""The result thread of the process pool: starts every worker, reads the result pipes, reaps dead workers.

:class:`ResultThread` holds explicit references to the :class:`~pc_pool._state.EngineState`, the
:class:`~pc_pool._workers.WorkerSet` and the pool's hooks (``pool_outqueue_get``, ``repopulate_pool``,
``maintain_pool``, ``terminate_workers``, ``join_workers``, so a subclass that overrides one is obeyed). It
blocks in ``poll`` (one reused object, see ``WorkerSet.wait_events``) on the result pipes, the worker
sentinels and the wakeup pipe. When a sentinel fires it drains that worker's pipe, fails the first unanswered
chunk (the one that was running) with :class:`~pc_pool.WorkerDiedError`, puts the rest back and starts a
replacement at the same index. It also starts the initial workers, so ``PR_SET_PDEATHSIG`` (which follows the
forking *thread*) fires only when the pool itself is gone. A reply that matches no chunk the worker holds
breaks the pool.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from pc_pool import _serial
from pc_pool._fdpass import installed_fds
from pc_pool._protocol import (
    K_ENC,
    K_ERR,
    K_INIT_ERR,
    K_OK,
    K_READY,
    K_RETIRE,
    MaybeEncodingError,
    unread_bytes,
)
from pc_pool._records import Chunk, WorkerHandle
from pc_pool._settings import CLOSE_GRACE, FAST_RTT, MAX_WINDOW, TICK, WINDOW, PoolStates, now
from pc_pool._signals import start_with_sigint_blocked
from pc_pool._state import EngineState
from pc_pool._workers import WorkerSet
from pc_pool.errors import PoolTerminatedError, RemoteTraceback, WorkerDiedError

__all__ = ["PoolHooks", "ResultThread"]

_log = logging.getLogger(__name__)
_MAX_UNREADY_DEATHS = 3  # consecutive deaths before "ready" that break the pool


class PoolHooks(Protocol):
    """The overridable hooks of :class:`~pc_pool.BasePool` that the result thread calls."""

    def pool_outqueue_get(self, timeout: float) -> list[tuple[int, Any]]: ...  # pragma: no cover
    def repopulate_pool(self) -> None: ...  # pragma: no cover
    def maintain_pool(self) -> None: ...  # pragma: no cover
    def terminate_workers(self) -> None: ...  # pragma: no cover
    def join_workers(self) -> None: ...  # pragma: no cover


class ResultThread:
    """The thread that owns the read ends of the result pipes and the lives of the workers.

    Args:
        state: The pool's engine state.
        workers: The pool's worker set (starts and closes worker handles).
        hooks: The pool, for its overridable hooks (held by the thread while it runs, not by this object).
        copy_tensor: ``False`` (share mode): release the payloads nobody will load when a worker is gone.
    """

    def __init__(
        self, state: EngineState, workers: WorkerSet, hooks: PoolHooks, *, copy_tensor: bool
    ) -> None:
        self._state = state
        self._workers = workers
        self._copy_tensor = copy_tensor
        self._started = threading.Event()
        # Set once the thread's work is done (workers reaped and closed). Callers wait on it rather than on
        # Thread.join: a Ctrl-C that interrupts Thread.join on CPython 3.10-3.12 marks a live thread as
        # stopped (gh-90882), and the terminate() that follows would then not wait for the reaping.
        self._finished = threading.Event()
        self._start_error: BaseException | None = None
        self._close_deadline: float | None = None
        self._unready_deaths = 0
        # The hooks (the pool) ride in the thread's arguments, which the thread drops when it ends: no
        # reference cycle keeps a finished pool from being freed by reference counting.
        self._thread = threading.Thread(target=self._run, args=(hooks,), name="pc_pool-results", daemon=True)

    # -- control (any thread) --------------------------------------------------------------------------------
    def start(self, timeout: float) -> BaseException | None:
        """Start the thread; wait up to ``timeout`` s for the first workers; return why they did not start."""
        start_with_sigint_blocked(self._thread)
        if not self._started.wait(timeout):
            return TimeoutError(f"pool workers did not start within {timeout} s")
        return self._start_error

    def is_current(self) -> bool:
        """Whether the calling thread is this result thread."""
        return threading.current_thread() is self._thread

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the thread's work to end; return whether it has (or never started).

        The caller's own result thread does not wait and gets ``True``.
        """
        if self._thread.ident is None or self.is_current():
            return True
        return self._finished.wait(timeout)

    # -- the thread ------------------------------------------------------------------------------------------
    def _run(self, hooks: PoolHooks) -> None:
        # Started with SIGINT blocked; workers are forked from here and inherit the mask: a Ctrl-C that lands
        # between fork and the worker's SIG_IGN stays pending and is then discarded, instead of raising
        # KeyboardInterrupt inside a half-started worker. The main thread still receives Ctrl-C.
        st = self._state
        try:
            hooks.repopulate_pool()
        except BaseException as exc:
            self._start_error = exc
            st.stopping = True
        finally:
            self._started.set()
        try:
            while not st.stopping:
                try:
                    events = hooks.pool_outqueue_get(TICK)
                except TimeoutError:
                    events = []
                    hooks.maintain_pool()  # backstop only: sentinels report deaths
                except OSError:
                    break
                for index, event in events:
                    if self._state.stopping:  # (not st.: mypy narrows that to False here)
                        self._discard(event)  # terminated or broken meanwhile: nothing more to deliver
                        continue
                    w = st.workers[index]
                    if w is None or w.dead:
                        continue
                    if event is None:
                        self.reap(w, hooks)
                    else:
                        self.handle_reply(w, *event)
                self._check_closed(hooks)
        except BaseException:  # pragma: no cover - a bug here must not leave callers hanging
            _log.exception("pc_pool result thread crashed; terminating the pool")
            st.fail_everything(PoolTerminatedError("the pool's result thread crashed"))
        finally:
            try:
                self._shutdown(hooks)
            finally:
                self._finished.set()

    def _check_closed(self, hooks: PoolHooks) -> None:
        """After a drained ``close()``: exit once every worker is gone (killing stragglers after a grace)."""
        st = self._state
        if st.state is not PoolStates.CLOSE or st.jobs:
            return
        with st.cond:
            st.cond.notify_all()  # feeders send EXIT
        if all(w is None for w in st.workers):
            st.stopping = True
            return
        if self._close_deadline is None:
            self._close_deadline = now() + CLOSE_GRACE
        elif now() > self._close_deadline:
            hooks.terminate_workers()

    def _shutdown(self, hooks: PoolHooks) -> None:
        st = self._state
        with st.cond:
            st.stopping = True
            st.cond.notify_all()
        hooks.terminate_workers()
        hooks.join_workers()
        for w in st.workers:
            if w is not None:
                if w.send_lock.acquire(timeout=TICK):  # a feeder mid-send finishes first, then none sends
                    w.dead = True
                    w.send_lock.release()
                if not self._copy_tensor:
                    self._release_in_flight(w)
                with st.cond:
                    w.outstanding.clear()  # their items are the callers' arguments (tensors, shared memory)
                self._workers.close(w)
        st.wakeup.close()

    def _discard(self, event: Any) -> None:
        """Drop a received message that will not be handled, giving back its share handles and fds."""
        if event is not None:
            _, blob, fds = event
            with installed_fds(fds):
                if not self._copy_tensor:
                    _serial.release(blob)

    def _release_in_flight(self, w: WorkerHandle) -> None:
        """Share mode, worker ``w`` is gone: give back the handles of payloads that nobody will load.

        Those are the chunks it never started (their bytes are still in its task pipe) and the replies it sent
        that were never read; without this their segments ('file_system') stay in ``/dev/shm`` until the
        last process using torch's shared-memory manager exits.
        """
        chunks = list(w.outstanding)
        running = _running_chunk(chunks, unread_bytes(w.task_conn))
        _serial.release_all(c.sent_payloads for c in chunks if c.sent and c is not running)
        with contextlib.suppress(EOFError, OSError):
            while w.reader.readable():
                self._discard(w.reader.recv())

    # -- replies ---------------------------------------------------------------------------------------------
    def handle_reply(
        self, w: WorkerHandle, header: tuple[Any, ...], blob: bytes | None, fds: Sequence[int] = ()
    ) -> None:
        """Act on one message from worker ``w``: readiness, retirement, an init error or a chunk's answer.

        ``fds`` came with the message (share mode, see :mod:`pc_pool._fdpass`): the payload's loads take
        them; whatever is left is closed here.
        """
        if not fds:
            self._handle_reply(w, header, blob)
            return
        with installed_fds(list(fds)):
            self._handle_reply(w, header, blob)

    def _handle_reply(self, w: WorkerHandle, header: tuple[Any, ...], blob: bytes | None) -> None:
        st = self._state
        kind, job_id, chunk_index, text = header
        if kind == K_READY:
            w.ready = True
            self._unready_deaths = 0
            return
        if kind == K_RETIRE:
            with st.cond:
                w.retiring = True
                st.requeue(w.outstanding)
                w.outstanding.clear()
            return
        if kind == K_INIT_ERR:
            st.break_pool(_load_exception(blob, text), "a worker failed to initialize")
            return
        with st.cond:
            chunk = w.outstanding[0] if w.outstanding else None
            matches = chunk is not None and chunk.job.id == job_id and chunk.index == chunk_index
            if chunk is not None and matches:
                w.outstanding.popleft()
                chunk.sent_payloads = ()  # the worker read them
                w.answered += 1
                _update_window(w, chunk)
                if len(w.outstanding) <= w.refill:
                    st.cond.notify_all()  # the feeder refills at this level (see Feeder._next_action)
        if chunk is None or not matches:
            expected = "nothing" if chunk is None else f"job {chunk.job.id} chunk {chunk.index}"
            cause = RuntimeError(
                f"pool worker {w.index} (pid {w.process.pid}) sent a reply for job {job_id} chunk "
                f"{chunk_index}, but the task it was running is {expected}"
            )
            st.break_pool(cause, "a worker sent a reply that matches no pending task")
            return
        if kind == K_OK:
            try:
                values = _serial.loads(blob) if blob is not None else None
            except Exception as exc:
                st.deliver(chunk, False, exc)
                return
            st.deliver(chunk, True, values)
        elif kind in (K_ERR, K_ENC):
            st.deliver(chunk, False, _load_exception(blob, text))

    # -- deaths ----------------------------------------------------------------------------------------------
    def maintain(self, hooks: PoolHooks) -> None:
        """Reap workers whose process ended (crash or retirement); start replacements through ``hooks``."""
        for w in list(self._state.workers):
            if w is not None and not w.dead and w.process.exitcode is not None:
                self.reap(w, hooks)
        hooks.repopulate_pool()

    def reap(self, w: WorkerHandle, hooks: PoolHooks) -> None:
        """Worker ``w``'s process ended: read what it left, fail its running chunk, start a replacement."""
        st = self._state
        try:
            while not st.stopping:
                msg = w.reader.recv()
                if msg is not None:
                    self.handle_reply(w, *msg)
        except (EOFError, OSError):
            pass
        w.process.join(TICK)
        exitcode, pid = w.process.exitcode, w.process.pid
        # A feeder mid-send to the dead worker gets EPIPE and lets go of send_lock.
        with w.send_lock, st.cond:
            w.dead = True
            chunks = list(w.outstanding)
            w.outstanding.clear()
            crashed = not w.retiring and not w.exit_sent and not st.stopping
            died = _running_chunk(chunks, unread_bytes(w.task_conn)) if crashed else None
            if died is not None:
                chunks.remove(died)
            unread = [c.sent_payloads for c in chunks if c.sent]  # never started: their bytes are in the pipe
            st.requeue(chunks)
            st.workers[w.index] = None
        self._workers.close(w)
        _serial.release_all(unread)  # re-dispatching dumps the chunks afresh
        if crashed and not w.ready:
            # Died before it was ready: killed during start-up, or an initializer that exits or crashes. Only
            # a run of such deaths with no ready worker in between breaks the pool (no respawn loop).
            self._unready_deaths += 1
            if self._unready_deaths >= _MAX_UNREADY_DEATHS:
                st.break_pool(WorkerDiedError(pid, exitcode), "workers keep dying before they are ready")
                return
        if crashed:
            _log.warning(
                "pc_pool worker %s (pid %s) died with exit code %s; replacing it", w.index, pid, exitcode
            )
        hooks.repopulate_pool()
        if died is not None:
            st.deliver(died, False, WorkerDiedError(pid, exitcode))


def _update_window(w: WorkerHandle, chunk: Chunk) -> None:
    """After ``chunk`` was answered: update ``w``'s service time and its window (caller holds ``cond``).

    The chunk's service time runs from when the worker could start it (sent, or the previous answer, whichever
    is later) to now; the window holds about ``FAST_RTT`` seconds of such chunks (2 to ``MAX_WINDOW``).
    """
    t = now()
    took = t - max(chunk.sent_at, w.last_reply_at)
    w.last_reply_at = t
    w.service = took if w.service is None else 0.75 * w.service + 0.25 * took
    w.window = max(WINDOW, min(MAX_WINDOW, int(FAST_RTT / max(w.service, 1e-6))))
    w.refill = w.window // 2


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
