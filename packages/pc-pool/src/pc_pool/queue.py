"""Inter-process queues over pipes: :class:`SimpleQueue`, :class:`SimpleP2PQueue` and :class:`MultiP2PQueue`.

Items travel through pc_pickle, so lambdas and tensors cross; ``copy_tensor=False`` (the default)
shares tensors, ``True`` copies them. A queue is passed to child processes as a ``Process`` argument
(it pickles only while spawning).

Waits and what ends them: ``get(timeout=None)`` waits until an item arrives, and also
ends when

* ``timeout`` seconds pass: ``multiprocessing.TimeoutError``;
* every write end of the pipe is closed, in every process: ``EOFError``;
* a process (or sentinel) passed in ``watch=`` ends first: ``EOFError`` naming it. Use it for the peer that
  should send: this process holds a write end too, so a dead peer alone never closes the pipe;
* Ctrl-C in the waiting (main) thread: ``KeyboardInterrupt``.

``put`` never waits for a reader, only for pipe space: a reader that stopped reading (or died while another
process still holds the read end) can block it once the pipe buffer is full.

Threads: every queue may be shared by the threads of a process. Within a process, writes to one pipe are
serialised by a lock (a message is written whole, never interleaved with another thread's), and a receiving
thread takes the read lock only to read a message that is ready, as between processes.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import threading
import time
from collections.abc import Iterable
from multiprocessing.connection import Connection, wait
from typing import Any

from pc_pool import _serial
from pc_pool._checks import positive_int
from pc_pool._signals import wait_in_slices

__all__ = ["MultiP2PQueue", "SimpleP2PQueue", "SimpleQueue"]


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _timeout_error(timeout: float | None) -> multiprocessing.TimeoutError:
    return multiprocessing.TimeoutError(f"no item arrived within {timeout} s")


def _sentinels(watch: Iterable[Any]) -> dict[Any, Any]:
    """Map each waitable of ``watch`` (a process's ``sentinel``, an fd, a ``Connection``) to its item."""
    if isinstance(watch, (str, bytes)) or not hasattr(watch, "__iter__"):
        raise TypeError(f"watch must be an iterable of processes or sentinels, got {type(watch).__name__}")
    found: dict[Any, Any] = {}
    for item in watch:
        sentinel = getattr(item, "sentinel", item)
        if isinstance(sentinel, bool) or not (isinstance(sentinel, int) or hasattr(sentinel, "fileno")):
            raise TypeError(
                f"watch items must be processes, sentinels (int) or connections, got {type(item).__name__}"
            )
        found[sentinel] = item
    return found


def _wait_item(readers: list[Connection], deadline: float | None, timeout: float | None, watch: Any) -> Any:
    """Wait until one of ``readers`` is readable and return it (see the module's "Waits" list)."""
    watched = _sentinels(watch)
    waitables = [*readers, *watched]
    ready: list[Any] = []

    def poll(seconds: float | None) -> bool:
        ready[:] = wait(waitables, seconds)
        return bool(ready)

    wait_in_slices(poll, _remaining(deadline))
    for reader in readers:
        if reader in ready or (ready and reader.poll(0)):  # an item sent before a peer exited still comes
            return reader
    if not ready:
        raise _timeout_error(timeout)
    names = ", ".join(repr(watched[s]) for s in ready if s in watched)
    raise EOFError(f"a watched process ended before an item arrived: {names}")


def _take(reader: Connection, lock: Any, timeout: float | None, watch: Any) -> Any:
    """Wait for a message on ``reader`` and read it under ``lock``, which is held only for a ready message.

    ``lock`` (a thread lock, or a process lock for a many-to-many queue) is taken only once the pipe is
    readable, so a receiver that waits, or dies while it waits, never keeps another from reading.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    watch = list(watch) if not isinstance(watch, (str, bytes)) and hasattr(watch, "__iter__") else watch
    while True:
        _wait_item([reader], deadline, timeout, watch)
        left = _remaining(deadline)
        if not lock.acquire(timeout=-1 if left is None else left):
            raise _timeout_error(timeout)
        try:
            # Another receiver may have taken the message between our wait and the lock.
            data = reader.recv_bytes() if reader.poll(0) else None
        finally:
            lock.release()
        if data is not None:
            return _serial.loads(data)


class SimpleP2PQueue:
    """A one-to-one queue (one sender process, one receiver process) over one pipe, with no process locks.

    Args:
        copy_tensor: Copy tensors (``True``) or share them (``False``, default).
    """

    def __init__(self, *, copy_tensor: bool = False) -> None:
        self._reader, self._writer = multiprocessing.Pipe(duplex=False)
        self._copy_tensor = bool(copy_tensor)
        self._threads_put, self._threads_get = threading.Lock(), threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        multiprocessing.context.assert_spawning(self)
        state = self.__dict__.copy()
        del state["_threads_put"], state["_threads_get"]  # per process: the receiving one makes its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._threads_put, self._threads_get = threading.Lock(), threading.Lock()

    def empty(self) -> bool:
        """Return whether no item is waiting."""
        return not self._reader.poll(0)

    def close(self) -> None:
        """Close both ends of the pipe in this process."""
        self._reader.close()
        self._writer.close()

    def put(self, obj: Any) -> None:
        """Put an object into the queue.

        Raises:
            pickle.PicklingError: ``obj`` cannot be pickled.
        """
        data = _serial.dumps(obj, copy_tensor=self._copy_tensor)
        with self._threads_put:  # a message is written whole, never interleaved with another thread's
            self._writer.send_bytes(data)

    def get(self, timeout: float | None = None, *, watch: Iterable[Any] = ()) -> Any:
        """Get an object from the queue, waiting up to ``timeout`` seconds (``None``: until one arrives).

        Args:
            timeout: Seconds to wait for the whole call; ``None`` waits until an item or a wake-up below.
            watch: Processes (or their ``sentinel``) whose end also ends the wait, e.g. the sender.

        Raises:
            multiprocessing.TimeoutError: Nothing arrived within ``timeout``.
            EOFError: Every writer closed the queue, or a watched process ended before an item arrived.
            TypeError: ``watch`` holds something that is not a process, a sentinel or a connection.
        """
        return _take(self._reader, self._threads_get, timeout, watch)

    @property
    def reader(self) -> Connection:
        """The read end of the pipe (for ``multiprocessing.connection.wait``)."""
        return self._reader


class SimpleQueue(SimpleP2PQueue):
    """A many-to-many queue over one pipe: any number of senders and receivers, in any processes.

    Unlike ``multiprocessing.SimpleQueue``, ``get`` waits for data *without* holding the read
    lock and takes the lock only to read a message that is ready, so a receiver killed while idle never blocks
    the others, and ``timeout`` bounds the whole call.

    Args:
        ctx: The ``multiprocessing`` context for the locks (default: spawn, usable by fork children too).
        copy_tensor: Copy tensors (``True``) or share them (``False``, default).
    """

    def __init__(
        self, *, ctx: multiprocessing.context.BaseContext | None = None, copy_tensor: bool = False
    ) -> None:
        super().__init__(copy_tensor=copy_tensor)
        ctx = ctx if ctx is not None else multiprocessing.get_context("spawn")
        self._rlock = ctx.Lock()
        self._wlock = ctx.Lock()

    def put(self, obj: Any) -> None:
        """Put an object into the queue (serialized before the write lock is taken).

        Raises:
            pickle.PicklingError: ``obj`` cannot be pickled.
        """
        data = _serial.dumps(obj, copy_tensor=self._copy_tensor)
        with self._wlock:
            self._writer.send_bytes(data)

    def get(self, timeout: float | None = None, *, watch: Iterable[Any] = ()) -> Any:
        """Get an object, waiting up to ``timeout`` seconds for the whole call (``None``: until one arrives).

        Args:
            timeout: Seconds to wait for the whole call; ``None`` waits until an item or a wake-up.
            watch: Processes (or their ``sentinel``) whose end also ends the wait, e.g. the senders.

        Raises:
            multiprocessing.TimeoutError: Nothing arrived within ``timeout``.
            EOFError: Every writer closed the queue, or a watched process ended before an item arrived.
        """
        return _take(self._reader, self._rlock, timeout, watch)


class MultiP2PQueue:
    """``queue_num`` one-to-one queues; ``put`` goes round-robin, ``get`` takes from whichever has an item.

    Args:
        queue_num: Number of underlying :class:`SimpleP2PQueue` instances.
        copy_tensor: Copy tensors (``True``) or share them (``False``, default).

    Raises:
        TypeError: ``queue_num`` is not an int.
        ValueError: ``queue_num < 1``.
    """

    def __init__(self, queue_num: int, *, copy_tensor: bool = False) -> None:
        count = positive_int("queue_num", queue_num)
        self.queues = [SimpleP2PQueue(copy_tensor=copy_tensor) for _ in range(count)]
        self._next = 0
        self._turn = threading.Lock()  # the round-robin position, per process

    def __getstate__(self) -> dict[str, Any]:
        multiprocessing.context.assert_spawning(self)
        state = self.__dict__.copy()
        del state["_turn"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._turn = threading.Lock()

    def empty(self) -> bool:
        """Return whether every underlying queue is empty."""
        return all(q.empty() for q in self.queues)

    def close(self) -> None:
        """Close every underlying queue in this process."""
        for q in self.queues:
            q.close()

    def put(self, obj: Any) -> None:
        """Put ``obj`` into the next queue, round-robin."""
        with self._turn:
            index = self._next
            self._next = (index + 1) % len(self.queues)
        self.queues[index].put(obj)

    def put_to(self, index: int, obj: Any) -> None:
        """Put ``obj`` into queue ``index``.

        Raises:
            IndexError: ``index`` is out of range.
        """
        if not 0 <= index < len(self.queues):
            raise IndexError(f"queue index must be in [0, {len(self.queues)}), got {index}")
        self.queues[index].put(obj)

    def get(self, timeout: float | None = None, *, watch: Iterable[Any] = ()) -> Any:
        """Get an object from any queue that has one, waiting up to ``timeout`` seconds.

        Args:
            timeout: Seconds to wait; ``None`` waits until an item arrives or a wake-up fires.
            watch: Processes (or their ``sentinel``) whose end also ends the wait, e.g. the senders.

        Raises:
            multiprocessing.TimeoutError: Nothing arrived within ``timeout``.
            EOFError: A watched process ended before an item arrived (or a queue's writers all closed).
        """
        readers = {q.reader: q for q in self.queues}
        deadline = None if timeout is None else time.monotonic() + timeout
        watch = list(watch) if not isinstance(watch, (str, bytes)) and hasattr(watch, "__iter__") else watch
        while True:
            reader = _wait_item(list(readers), deadline, timeout, watch)
            try:
                return readers[reader].get(0)
            except multiprocessing.TimeoutError:  # another thread took that item: wait for the next one
                if deadline is not None and time.monotonic() >= deadline:
                    raise _timeout_error(timeout) from None
