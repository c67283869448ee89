"""What runs inside a worker process: bootstrap, the task loop, the per-job function cache and context access.

Bootstrap (:func:`worker_main`): ignore SIGINT (the parent handles Ctrl-C), ask Linux to SIGKILL us when the
parent thread that started us dies (``PR_SET_PDEATHSIG``) and re-check the parent, turn ``faulthandler`` on,
load the initializer, its arguments and the worker's context, then run the pool's ``worker`` hook.

The task loop (:func:`worker_loop`, the default ``BasePool.worker``) reads one chunk at a time, so the parent
knows which chunk was running when the worker died. The function of a job arrives with the worker's first
chunk of that job, is loaded once and cached by job id until the parent says the job ended.

In share mode the worker keeps the CUDA storages it opened for the last chunk's arguments until the next
chunk's arguments are loaded (:class:`_LastArguments`): torch reuses an opened CUDA IPC handle only while the
receiving process still holds its storage, so a caller that sends the same CUDA tensor chunk after chunk
opens its handle once instead of once per chunk.
"""

from __future__ import annotations

import collections
import ctypes
import faulthandler
import logging
import multiprocessing
import multiprocessing.pool
import os
import select
import signal
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from pc_pool import _serial
from pc_pool._fdpass import close_fds, collecting_fds
from pc_pool._protocol import (
    K_ENC,
    K_ERR,
    K_INIT_ERR,
    K_OK,
    K_READY,
    K_RETIRE,
    MODE_APPLY,
    MODE_MAP,
    MaybeEncodingError,
    recv_msg,
    send_msg,
)

__all__ = ["CtxPoolStorage", "ResultPutter", "TaskGetter", "proxy_ctx_caller", "worker_loop", "worker_main"]

_log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1
_FUNC_CACHE_SIZE = 32
# (header, payload) or (header, payload, fds): fds (share mode) travel with the message and are closed here.
_Reply = tuple[Any, ...]


class CtxPoolStorage:
    """Holds the context of the current worker of a ``CtxPool``.

    Each worker process has its own memory, so ``storage`` is the context of *this* worker (``None`` outside a
    context pool). It is set before the initializer runs.
    """

    storage: Any = None


def proxy_ctx_caller(*input_: Any) -> Any:
    """Call a function with the worker context: ``proxy_ctx_caller(func, *args)`` is ``func(ctx, *args)``.

    Args:
        *input_: The function, then its positional arguments.

    Returns:
        What the function returned.
    """
    if not input_:
        raise TypeError("proxy_ctx_caller needs the function as its first argument, got no arguments")
    func, *args = input_
    return func(CtxPoolStorage.storage, *args)


# ------------------------------------------------------------------------------------------------------------
# Replies
# ------------------------------------------------------------------------------------------------------------
def _dump_reply(obj: Any, copy_tensor: bool) -> tuple[bytes, list[int]]:
    """Dump a result or an exception; in share mode also return the fds to pass along (see ``_fdpass``)."""
    if copy_tensor:
        return _serial.dumps(obj, copy_tensor=True), []
    with collecting_fds() as fds:
        try:
            return _serial.dumps(obj, copy_tensor=False), fds
        except BaseException:
            close_fds(fds)
            raise


def _error_reply(kind: int, job: int, chunk: int, exc: BaseException, copy_tensor: bool) -> _Reply:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob, fds = _dump_reply(exc, copy_tensor)
        return (kind, job, chunk, tb), blob, fds
    except Exception as dump_exc:
        # The exception itself cannot travel: send the stdlib's MaybeEncodingError (reprs only) instead.
        enc = MaybeEncodingError(dump_exc, exc)
        return (K_ENC if kind == K_ERR else kind, job, chunk, tb), _serial.dumps(enc)


class _LastArguments:
    """Loads each chunk's arguments and keeps the CUDA storages opened for the last one until the next load.

    Why: opening a CUDA IPC handle (``cudaIpcOpenMemHandle``) is most of what receiving a shared CUDA tensor
    costs, and torch reuses an opened handle only while this process still holds the storage it opened it for.
    Arguments are dropped when their chunk ends, so without this every chunk that sends the same CUDA tensor
    would open its handle again.

    Bounds: at most one chunk's storages are kept. They are dropped once the next chunk's arguments are loaded
    (reused or not) and by :meth:`release`, which the worker calls when it stops taking chunks (exit request,
    retirement, ``terminate()``, a failing ``worker`` hook). Only CUDA storages opened from share handles are
    kept (pc_pickle reports none on a torch whose handle reuse it does not recognise); tensors are the
    caller's memory, so writes show exactly as before. The cost: the caller's CUDA block stays referenced
    until this worker's next chunk, so the caller cannot free it before then (a worker killed by SIGKILL never
    gives it back, as with any chunk it dies in).
    """

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        self._kept: list[Any] = []

    def load(self, blob: bytes) -> Any:
        """Load a chunk's arguments, then drop the previous chunk's storages and keep this chunk's.

        Args:
            blob: The arguments payload (share mode).

        Returns:
            The loaded arguments.
        """
        opened: list[Any] = []
        try:
            return _serial.loads(blob, opened_cuda=opened)
        finally:
            # Only now: the load above reused the handles of the storages it finds still held here.
            self._kept = opened

    def release(self) -> None:
        """Drop the kept storages (the worker takes no more chunks)."""
        self._kept = []


class _Task:
    """One chunk read from the task pipe; calling it runs the chunk and returns the reply (never raises)."""

    __slots__ = ("args_blob", "cache", "chunk", "copy_tensor", "job", "last_args", "mode")

    def __init__(
        self,
        header: tuple[Any, ...],
        blob: bytes | None,
        cache: dict[int, Any],
        copy: bool,
        last_args: _LastArguments | None = None,
    ) -> None:
        self.job, self.chunk, self.mode = header[0], header[1], header[2]
        self.args_blob = blob
        self.cache = cache
        self.copy_tensor = copy
        self.last_args = last_args

    def release(self) -> None:
        """Give back the share handles of the arguments when the chunk will not run (retirement)."""
        if not self.copy_tensor:
            _serial.release(self.args_blob)
        self.args_blob = None

    def __call__(self) -> _Reply:
        try:
            func = self.cache[self.job]
            if isinstance(func, _LoadFailure):
                raise func.exc
            assert self.args_blob is not None
            if self.last_args is None:
                items = _serial.loads(self.args_blob)
            else:
                items = self.last_args.load(self.args_blob)
            self.args_blob = None
            if self.mode == MODE_APPLY:
                args, kwds = items[0]
                values = [func(*args, **kwds)]
            elif self.mode == MODE_MAP:
                values = [func(x) for x in items]
            else:
                values = [func(*x) for x in items]
        except SystemExit:
            if self.args_blob is not None:  # SIGTERM before the arguments were loaded: nobody else will
                self.release()
            raise  # sys.exit in a task ends the worker; the parent reports WorkerDiedError
        except BaseException as exc:
            return _error_reply(K_ERR, self.job, self.chunk, exc, self.copy_tensor)
        try:
            blob, fds = _dump_reply(values, self.copy_tensor)
            return (K_OK, self.job, self.chunk, None), blob, fds
        except Exception as exc:
            enc = MaybeEncodingError(exc, values)
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            return (K_ENC, self.job, self.chunk, tb), _serial.dumps(enc)


class _LoadFailure:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _Readable:
    """Blocks until a connection has a message; exits the process at once if the parent dies first.

    One ``select.poll`` object is kept for the worker's life (``Connection.poll`` builds a selector per call,
    ~10 us, paid on every task): a ready pipe costs one ``poll`` system call.
    """

    def __init__(self, conn: Any, parent_sentinel: Any | None) -> None:
        self._fd = conn.fileno()
        self._poller = select.poll()
        self._poller.register(self._fd, select.POLLIN)
        if parent_sentinel is not None:
            self._poller.register(parent_sentinel, select.POLLIN)

    def wait(self) -> None:
        """Return once the connection is readable (or at EOF); ``os._exit(1)`` if the parent is gone."""
        while True:
            events = self._poller.poll(60_000)
            if any(fd == self._fd for fd, _ in events):
                return
            if events:  # the parent sentinel fired
                os._exit(1)


class TaskGetter:
    """``get()`` of the worker loop: the next task, or ``None`` when the parent asks the worker to exit.

    It also exits the process when the parent process is gone (a backstop for ``PR_SET_PDEATHSIG``). In share
    mode its tasks load their arguments through one :class:`_LastArguments`, released by :meth:`release` and
    when the parent asks the worker to exit.
    """

    def __init__(self, conn: Connection, copy_tensor: bool) -> None:
        self._conn = conn
        self._copy = copy_tensor
        self._last_args = None if copy_tensor else _LastArguments()
        self._funcs: dict[int, Any] = {}
        self._by_blob: collections.OrderedDict[bytes, Any] = collections.OrderedDict()
        parent = multiprocessing.parent_process()
        self._readable = _Readable(conn, parent.sentinel if parent is not None else None)

    def _load_func(self, blob: bytes) -> Any:
        # Copied payloads are pure bytes: the same function sent for another job needs no second load. Shared
        # payloads carry one-shot handles and are always loaded.
        if not self._copy:
            return _serial.loads(blob)
        func = self._by_blob.get(blob)
        if func is None:
            func = _serial.loads(blob)
            self._by_blob[blob] = func
            while len(self._by_blob) > _FUNC_CACHE_SIZE:
                self._by_blob.popitem(last=False)
        else:
            self._by_blob.move_to_end(blob)
        return func

    def __call__(self) -> _Task | None:
        """Block until the next message; return the task, or ``None`` for the parent's exit request."""
        self._readable.wait()
        try:
            msg = recv_msg(self._conn)
        except EOFError:
            os._exit(1)
        if msg is None:
            self.release()
            return None
        header, blob, fds = msg
        close_fds(fds)  # the parent never passes fds to a worker
        job, _, _, func_blob, drops = header
        for dropped in drops:
            self._funcs.pop(dropped, None)
        if func_blob is not None:
            try:
                self._funcs[job] = self._load_func(func_blob)
            except SystemExit:
                raise
            except BaseException as exc:
                self._funcs[job] = _LoadFailure(exc)
        elif job not in self._funcs:
            self._funcs[job] = _LoadFailure(RuntimeError(f"function of job {job} never reached this worker"))
        return _Task(header, blob, self._funcs, self._copy, self._last_args)

    def release(self) -> None:
        """Drop the CUDA storages kept from the last task's arguments (see :class:`_LastArguments`)."""
        if self._last_args is not None:
            self._last_args.release()


class ResultPutter:
    """``put(reply)`` of the worker loop: send one reply to the parent.

    Share mode (``share``): a reply that could not be sent (SIGTERM) gives its share handles back. No wait
    for the parent to load a result: its fds travel with it (:mod:`pc_pool._fdpass`), so it survives the
    worker's death once sent. ``wait_ack=True`` keeps the older handshake (wait for ``RESULT_ACK`` after each
    result) for a custom ``worker`` whose parent sends one; the pool's result thread does not.
    """

    def __init__(self, conn: Connection, wait_ack: bool = False, *, share: bool = False) -> None:
        self._conn = conn
        self._wait_ack = wait_ack
        self._share = share or wait_ack
        parent = multiprocessing.parent_process()
        sentinel = parent.sentinel if parent is not None else None
        self._readable = _Readable(conn, sentinel) if wait_ack else None

    def __call__(self, reply: _Reply) -> None:
        """Send ``reply``, ``(header, payload)`` or ``(header, payload, fds)``; exit if the parent is gone."""
        header, blob, *rest = reply
        fds: list[int] = rest[0] if rest else []
        sent = False
        try:
            send_msg(self._conn, header, blob, fds)
            sent = True
        except (BrokenPipeError, ConnectionResetError):
            os._exit(1)  # the parent is gone
        finally:
            close_fds(fds)  # in flight (or lost with the parent): the kernel holds what was sent
            if not sent and self._share:  # SIGTERM (terminate) before it left: give its handles back
                _serial.release(blob)
        if self._wait_ack and header[0] == K_OK:
            self._await_ack()

    def _await_ack(self) -> None:
        assert self._readable is not None
        self._readable.wait()
        try:
            self._conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(1)  # the parent is gone


# ------------------------------------------------------------------------------------------------------------
# The loop and the bootstrap
# ------------------------------------------------------------------------------------------------------------
def worker_loop(
    get: Callable[[], Any],
    put: Callable[[Any], None],
    initializer: Callable[..., object] | None = None,
    initargs: tuple[Any, ...] = (),
    maxtasks: int | None = None,
) -> None:
    """The default worker: run the initializer, then tasks until told to exit or ``maxtasks`` are done.

    Args:
        get: Returns the next task (a callable returning the reply) or ``None`` to exit.
        put: Sends one reply to the parent.
        initializer: Called once with ``initargs`` before the first task.
        initargs: Arguments of ``initializer``.
        maxtasks: Number of tasks after which the worker retires (``None``: never).
    """
    try:
        if initializer is not None:
            initializer(*initargs)
    except SystemExit:
        raise
    except BaseException as exc:
        put(_error_reply(K_INIT_ERR, -1, -1, exc, copy_tensor=True))
        return
    put(((K_READY, -1, -1, None), None))
    done = 0
    while maxtasks is None or done < maxtasks:
        task = get()
        if task is None:
            return
        put(task())
        del task
        done += 1
    # Retirement handshake: announce it, then drain (without running) whatever was already sent until the
    # parent acknowledges. The parent loads our fd-shared results while we are still alive and re-dispatches
    # the rest.
    put(((K_RETIRE, -1, -1, None), None))
    while (task := get()) is not None:
        release = getattr(task, "release", None)
        if release is not None:
            release()  # share mode: give back the handles of arguments this worker will never load


class _Terminated(SystemExit):
    """Raised by SIGTERM in a worker; ``worker_main`` catches it once the stack has unwound."""


_terminating = False  # set by the first SIGTERM this worker handles


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    # terminate() sends SIGTERM: unwinding (instead of dying at once) drops the shared tensors this worker
    # holds, so their /dev/shm segments ('file_system') are not left behind; SIGKILL follows after 1 s.
    # terminate() repeats SIGTERM until the worker exits: only the first one it handles raises, so the
    # unwinding it started is not cut short by another.
    global _terminating
    if _terminating:
        return
    _terminating = True
    raise _Terminated(128 + signum)


def _die_of_sigterm() -> None:
    """Exit as SIGTERM's default action would (exit status -SIGTERM), skipping interpreter clean-up."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    os._exit(128 + signal.SIGTERM)  # pragma: no cover - not reached


def _set_parent_death_signal() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        _log.debug("PR_SET_PDEATHSIG unavailable", exc_info=True)


def worker_main(
    worker_fn: Callable[..., None],
    task_conn: Connection,
    result_conn: Connection,
    init_blob: bytes,
    copy_tensor: bool,
    maxtasks: int | None,
    parent_pid: int,
) -> None:
    """Entry point of a worker process (the ``target`` of its ``Process``).

    Args:
        worker_fn: The pool's ``worker`` hook.
        task_conn: Read end of this worker's task pipe.
        result_conn: Write end of this worker's result pipe.
        init_blob: pc_pickle payload of ``(initializer, initargs, has_context, context)``.
        copy_tensor: Copy (``True``) or share tensors in results.
        maxtasks: ``maxtasksperchild``.
        parent_pid: The pool process; if it is already gone, exit at once.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if hasattr(signal, "pthread_sigmask"):  # blocked by the parent thread that started us (see _collector)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _set_parent_death_signal()
    if os.getppid() != parent_pid:  # the parent died before PR_SET_PDEATHSIG took effect
        os._exit(1)
    faulthandler.enable()
    put = ResultPutter(result_conn, share=not copy_tensor)
    try:
        initializer, initargs, has_ctx, ctx = _serial.loads(init_blob)
    except SystemExit:
        raise
    except BaseException as exc:
        put(_error_reply(K_INIT_ERR, -1, -1, exc, copy_tensor=True))
        return
    if has_ctx:
        CtxPoolStorage.storage = ctx
    terminated = False
    get = TaskGetter(task_conn, copy_tensor)
    try:
        worker_fn(get, put, initializer, tuple(initargs), maxtasks)
    except _Terminated:
        terminated = True
    finally:
        get.release()  # give the callers' CUDA blocks back before exiting (also after SIGTERM or a failure)
    _serial.collect_cuda_ipc()  # results this worker shared that the pool has let go of
    if terminated:  # outside the except block: its traceback (and the frames' tensors) are gone by now
        _die_of_sigterm()
