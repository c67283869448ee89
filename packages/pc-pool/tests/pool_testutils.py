"""Task functions of the pc-pool tests (importable by spawned workers) and the call-form driver."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from typing import Any

import pc_pool

FORMS = ["apply", "apply_async", "map", "map_async", "starmap", "starmap_async", "imap", "imap_unordered"]
T = 30  # every get/next in the tests waits at most this long


def is_ctx(pool: Any) -> bool:
    return isinstance(pool, pc_pool.CtxPool)


def call(pool: Any, form: str, func: Any, x: Any) -> Any:
    """Run ``func(x)`` (``func(ctx, x)`` on context pools) once through call form ``form``."""
    if form == "apply":
        return pool.apply(func, (x,))
    if form == "apply_async":
        return pool.apply_async(func, (x,)).get(T)
    if form == "map":
        return pool.map(func, [x])[0]
    if form == "map_async":
        return pool.map_async(func, [x]).get(T)[0]
    if form == "starmap":
        return pool.starmap(func, [(x,)])[0]
    if form == "starmap_async":
        return pool.starmap_async(func, [(x,)]).get(T)[0]
    if form in ("imap", "imap_unordered"):
        it = getattr(pool, form)(func, [x])
        return it.next(timeout=T)
    raise AssertionError(form)


def last(args: tuple[Any, ...]) -> Any:
    return args[-1]


def ident(*args: Any) -> Any:
    return args[-1]


def double_sum(*args: Any) -> float:
    return float((args[-1] * 2).sum())


def raise_value_error(*args: Any) -> None:
    raise ValueError(f"boom {args[-1]}")


class Unpicklable:
    """Refuses to be pickled (dill and pc_pickle pickle a threading.Lock, so a lock is no test object)."""

    def __reduce__(self) -> Any:
        raise TypeError("Unpicklable refuses to be pickled")


def return_unpicklable(*args: Any) -> Any:
    return Unpicklable()


def kill_self(*args: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def exit_3(*args: Any) -> None:
    os._exit(3)


def sys_exit_3(*args: Any) -> None:
    sys.exit(3)


def segfault(*args: Any) -> None:
    ctypes.string_at(0)


def getpid(*args: Any) -> int:
    return os.getpid()


def sleep_long(*args: Any) -> None:
    time.sleep(30)  # killed by terminate() long before it returns


def sleep_hour(*args: Any) -> None:
    time.sleep(3600)  # outlasts any test: only terminate() (or the process's exit) ends it


def in_worker() -> bool:
    return multiprocessing.parent_process() is not None


class FailsToLoadInWorker:
    """Pickles fine, but unpickling raises inside a worker process."""

    def __reduce__(self) -> Any:
        return (_load_in_parent_only, ())


def _load_in_parent_only() -> FailsToLoadInWorker:
    if in_worker():
        raise RuntimeError("refusing to load in the worker")
    return FailsToLoadInWorker()


class FailsToLoadInParent:
    """Pickles fine, but unpickling raises in the test (parent) process."""

    def __reduce__(self) -> Any:
        return (_load_in_worker_only, ())


def _load_in_worker_only() -> FailsToLoadInParent:
    if not in_worker():
        raise RuntimeError("refusing to load in the parent")
    return FailsToLoadInParent()


def return_parent_unloadable(*args: Any) -> FailsToLoadInParent:
    return FailsToLoadInParent()


class UnpicklableError(Exception):
    def __reduce__(self) -> Any:
        raise TypeError("this exception refuses to be pickled")


def raise_unpicklable(*args: Any) -> None:
    raise UnpicklableError("cannot travel")


class CountingFunc:
    """A callable that counts how often it was unpickled in this process."""

    loads = 0

    def __reduce__(self) -> Any:
        return (_make_counting, ())

    def __call__(self, *args: Any) -> tuple[int, int]:
        return os.getpid(), CountingFunc.loads


def _make_counting() -> CountingFunc:
    CountingFunc.loads += 1
    return CountingFunc()


def make_pool_in_task(daemon_flag: bool) -> int:
    with pc_pool.Pool(1, share_method="cpu", is_daemon=daemon_flag) as inner:
        return int(inner.apply(ident, (7,)))


def failing_initializer() -> None:
    raise OSError("initializer failed on purpose")


def misreplying_worker(
    get: Any, put: Any, initializer: Any = None, initargs: Any = (), maxtasks: Any = None
) -> None:
    """A ``BasePool.worker`` hook that answers every task as if it were another chunk (a protocol bug).

    ``initargs[0]`` is the read end of a pipe inherited through fork: each bad reply waits for one byte on it,
    so the test decides when the pool breaks.
    """
    from pc_pool._protocol import K_OK, K_READY

    put(((K_READY, -1, -1, None), None))
    while (task := get()) is not None:
        (_, job, chunk, _), blob, *fds = task()
        os.read(initargs[0], 1)
        put(((K_OK, job, chunk + 1000, None), blob, *fds))


_calls = threading.local()


def where_and_when(*args: Any) -> tuple[int, int, int]:
    """(pid, thread id, how many calls this thread made before): the calls of one chunk are consecutive."""
    seq = getattr(_calls, "n", 0)
    _calls.n = seq + 1
    return os.getpid(), threading.get_ident(), seq


def raise_on_3(*args: Any) -> Any:
    x = args[-1]  # a context pool passes its worker's context first
    if x == 3:
        raise ValueError("element 3")
    return x
