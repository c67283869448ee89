"""Replica threads kept between forwards: a thread per replica without starting one per forward.

Starting and joining a thread per replica was most of the fixed cost of a CPU-replica forward (the benchmark's
"thread start/join" row; docs/replicate.md has the profile), and each new thread
also re-applied the intra-op thread setting. A :class:`ReplicaThreads` keeps its threads idle between calls::

    submit(work, report) ──► an idle thread (or a new one: a call never waits for a busy thread)
                                 │ outcome = work()          (work catches everything it raises)
                                 │ back to the idle list     (before report, so the next call finds it)
                                 └ report(outcome)            (wakes the caller)

A thread whose task left torch's thread-local state changed (grad mode, inference mode, autocast) is not
reused: it ends instead, so the next task starts from a fresh thread's state. The threads end when
:meth:`ReplicaThreads.close` is called, which :func:`threads_of` arranges for when the owning module is
garbage collected. In a child forked from the process, the inherited pool is empty and starts over.

Waits and what ends them: an idle thread waits on its own queue with no timeout; ``close()`` (or the owner's
collection) puts the sentinel that ends it. Tasks never wait on the pool: ``submit`` starts a thread when
none is idle, so nested and concurrent calls cannot deadlock on each other.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from pc_replicate import _threadstate

__all__ = ["ReplicaThreads", "threads_of"]

_STOP = None
_Task = tuple[Callable[[], Any], Callable[[Any], None]]


class _Thread:
    """One pooled thread and the queue it takes its tasks from."""

    def __init__(self, pool: ReplicaThreads, name: str) -> None:
        self.tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, args=(pool,), name=name, daemon=True)

    def _serve(self, pool: ReplicaThreads) -> None:
        while self._run_one(pool):
            pass

    def _run_one(self, pool: ReplicaThreads) -> bool:
        """Run the next task; whether to take another. Its locals die here: an idle thread holds nothing.

        (An outcome kept across the wait would hold an exception whose traceback, re-raised in the caller,
        holds the caller's frames and so the module that owns this pool: it would never be collected.)
        """
        task = self.tasks.get()
        if task is _STOP:
            return False
        work, report = task
        outcome = work()
        reusable = _threadstate.thread_is_default()
        if reusable:
            pool._return(self)
        else:
            pool._forget(self)
        report(outcome)
        return reusable


class ReplicaThreads:
    """Daemon threads that run replicas, kept idle between calls.

    Args:
        name: The threads' name prefix (a counter is appended).
    """

    def __init__(self, name: str = "pc-replicate-replica") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._idle: list[_Thread] = []
        self._live: set[_Thread] = set()
        self._closed = False
        self._pid = os.getpid()
        self._counter = itertools.count()

    def submit(self, work: Callable[[], Any], report: Callable[[Any], None]) -> None:
        """Run ``report(work())`` on an idle thread, or on a new one when none is idle.

        ``work`` must not raise (it is the caller's job to turn an exception into an outcome); ``report`` runs
        after the thread is idle again.

        Raises:
            RuntimeError: The pool was closed.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("ReplicaThreads: the pool was closed")
            if self._pid != os.getpid():  # a forked child: the parent's threads do not exist here
                self._idle.clear()
                self._live.clear()
                self._pid = os.getpid()
            worker = self._idle.pop() if self._idle else None
            if worker is None:
                worker = _Thread(self, f"{self._name}-{next(self._counter)}")
                self._live.add(worker)
                worker.thread.start()
        worker.tasks.put((work, report))

    @property
    def size(self) -> int:
        """The number of live threads (idle or busy)."""
        with self._lock:
            return len(self._live)

    def close(self) -> None:
        """End every thread once its current task (if any) is done; idempotent. Nothing waits here."""
        with self._lock:
            self._closed = True
            live, self._live, self._idle = list(self._live), set(), []
        for worker in live:
            worker.tasks.put(_STOP)

    def _return(self, worker: _Thread) -> None:
        with self._lock:
            if self._closed or worker not in self._live:
                worker.tasks.put(_STOP)
            else:
                self._idle.append(worker)

    def _forget(self, worker: _Thread) -> None:
        with self._lock:
            self._live.discard(worker)


_pools: weakref.WeakKeyDictionary[Any, ReplicaThreads] = weakref.WeakKeyDictionary()
_pools_lock = threading.Lock()


def threads_of(owner: Any) -> ReplicaThreads:
    """The pool of ``owner`` (created on first use), closed when ``owner`` is garbage collected.

    The pool is kept outside the owner, so copying or pickling the owner never meets a thread or a lock.
    """
    with _pools_lock:
        pool = _pools.get(owner)
        if pool is None:
            pool = _pools[owner] = ReplicaThreads()
            weakref.finalize(owner, pool.close)
        return pool
