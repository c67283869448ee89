"""Master/slave message passing between the replicas of one data-parallel forward.

One round, with ``n`` registered slaves::

    slave k (thread k)                         master (thread 0)
    ------------------                         -----------------
    queue.put((k, msg_k)) ───────────────────► collect n messages (by id, before the deadline)
    result_k.get(timeout)                      callback([(0, msg_0), (1, msg_1), ...])  # registration order
          ▲                                    check: reply 0 first, one reply per slave
          └──────────────────────────────────── result_k.put(reply_k);  return reply_0

No acknowledgement travels back on the shared queue: a slave posts round ``r + 1`` only after it fetched its
reply to round ``r``, and the master answers nobody before it holds all of round ``r``, so every collection
sees exactly its own round and every ``put`` finds an empty slot.

**Cost of a round.** A round is one hand-off each way per slave: the master wakes at most once per slave
message (fewer when messages are already queued), and each slave wakes once, on its reply. Every wait is a
single C-level blocking call with a timeout (``SimpleQueue.get`` for the master, a lock acquire for a slave's
:class:`FutureResult`), so a waiting thread allocates nothing and re-checks nothing when it wakes. What the
round checks it checks once per round: the senders' ids against a table made at registration (one look-up
per message), and the callback's replies before any of them is delivered, so that a malformed reply set
aborts every participant instead of answering some of them.

Every wait has a timeout. :meth:`SyncMaster.abort` wakes the master and every slave at once; after it, every
wait raises :class:`~pc_sync.errors.SyncAbortedError` chained to the original error.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

from pc_sync.errors import DEFAULT_SYNC_TIMEOUT, SyncAbortedError, SyncError, SyncTimeoutError

__all__ = ["FutureResult", "SlavePipe", "SyncMaster", "check_timeout"]

logger = logging.getLogger(__name__)

MasterCallback = Callable[[list[tuple[Hashable, Any]]], Sequence[tuple[Hashable, Any]]]

_EQUAL_CALLS_RULE = (
    "every replica must call each synchronized module equally often in one forward "
    "(the same control flow on every replica)"
)
_INF = math.inf
# A lock's acquire takes no timeout above this; a longer (finite) timeout waits this long instead.
_WAIT_MAX = threading.TIMEOUT_MAX


class _Abort:
    """Sentinel put on the master's queue by :meth:`SyncMaster.abort` to wake a collecting master."""


_ABORT = _Abort()
_NO_REPLY = object()  # marks a slave without a reply while the master checks the callback's replies


def check_timeout(timeout: float | None) -> float:
    """Validate a timeout in seconds; ``None`` means :data:`~pc_sync.errors.DEFAULT_SYNC_TIMEOUT`.

    Args:
        timeout: A positive, finite number of seconds, or ``None``.

    Returns:
        The timeout as a float.

    Raises:
        TypeError: If ``timeout`` is not a real number.
        ValueError: If ``timeout`` is not positive and finite.
    """
    if timeout.__class__ is float and 0.0 < timeout < _INF:  # the common case, decided at once
        return timeout
    if timeout is None:
        return DEFAULT_SYNC_TIMEOUT
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}: {timeout!r}")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")
    return float(timeout)


class FutureResult:
    """A reusable, thread-safe one-value slot: one thread puts, another gets.

    ``None`` is an ordinary value. After :meth:`set_exception` the slot is closed for good: every ``get``
    raises :class:`~pc_sync.errors.SyncAbortedError` chained to that exception.

    A waiting ``get`` blocks on one lock that is held exactly while the slot has neither a value nor an error,
    so only a ``put`` or a ``set_exception`` can release it, and a released waiter never needs to wait again.

    Examples:
        >>> slot = FutureResult()
        >>> slot.put(None)
        >>> slot.get(timeout=1.0) is None
        True
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()  # guards the fields below
        # Held while there is nothing to take: released by put/set_exception, taken back by the get that
        # takes the value. A get that finds an error releases it again, so every later get raises at once.
        self._ready = threading.Lock()
        self._ready.acquire()
        self._has_value = False
        self._value: Any = None
        self._error: BaseException | None = None

    def put(self, result: Any) -> None:
        """Store ``result`` and wake the waiting ``get``.

        A value put into an aborted slot is dropped, since no ``get`` can return it.

        Args:
            result: Any object, ``None`` included.

        Raises:
            SyncError: If the slot already holds a value that nobody fetched.
        """
        with self._mutex:
            if self._error is not None:
                return
            if self._has_value:
                raise SyncError("FutureResult.put into a full slot: the previous value was never fetched")
            self._value = result
            self._has_value = True
            self._ready.release()

    def set_exception(self, exc: BaseException) -> None:
        """Close the slot: wake the waiting ``get`` and make every later ``get`` raise.

        Args:
            exc: The original error; it becomes the ``__cause__`` of the raised ``SyncAbortedError``.
        """
        with self._mutex:
            if self._error is not None:
                return
            self._error = exc
            if not self._has_value:  # with a value in, the lock is already released (or taken by a get)
                self._ready.release()

    def get(self, timeout: float | None = None) -> Any:
        """Wait for the value, return it and empty the slot.

        Args:
            timeout: Seconds to wait; ``None`` means :data:`~pc_sync.errors.DEFAULT_SYNC_TIMEOUT`.

        Returns:
            The value passed to :meth:`put`.

        Raises:
            SyncTimeoutError: If no value arrived in time.
            SyncAbortedError: If the slot was closed by :meth:`set_exception`.
        """
        return self._take(check_timeout(timeout))

    def _take(self, limit: float) -> Any:
        """:meth:`get` with a timeout already checked."""
        if not self._ready.acquire(True, limit if limit < _WAIT_MAX else _WAIT_MAX):
            raise SyncTimeoutError(f"FutureResult.get: no value within {limit:g} s")
        with self._mutex:
            error = self._error
            if error is not None:
                self._ready.release()
                raise SyncAbortedError(f"synchronisation aborted: {error!r}") from error
            value = self._value
            self._value = None
            self._has_value = False
            return value


class _SlavePipeBase(NamedTuple):
    identifier: Hashable
    queue: queue.SimpleQueue[Any]
    result: FutureResult


class SlavePipe(_SlavePipeBase):
    """Pipe for master-slave communication: a slave's end of one :class:`SyncMaster`.

    "Slave" names a non-master participant (a public compatibility name). The fields are ``identifier``
    (the id given to :meth:`SyncMaster.register_slave`), ``queue`` (shared by all slaves, read by the master)
    and ``result`` (this slave's :class:`FutureResult`).
    """

    __slots__ = ()

    def run_slave(self, msg: Any, *, timeout: float = DEFAULT_SYNC_TIMEOUT) -> Any:
        """Send ``msg`` to the master and wait for the master's reply.

        Args:
            msg: The message; any object, ``None`` included.
            timeout: Seconds to wait for the reply.

        Returns:
            The reply the master's callback gave for this slave.

        Raises:
            SyncTimeoutError: If the master did not answer in time (``missing == (0,)``).
            SyncAbortedError: If the exchange was aborted; ``__cause__`` is the original error.
        """
        limit = check_timeout(timeout)
        self.queue.put((self.identifier, msg))
        try:
            return self.result._take(limit)
        except SyncTimeoutError:
            raise SyncTimeoutError(
                f"slave {self.identifier!r} got no reply from the master (id 0) within {limit:g} s; "
                f"{_EQUAL_CALLS_RULE}",
                missing=(0,),
            ) from None


class _Roster:
    """The registry as a round reads it: made once per registration, read-only while rounds run.

    Attributes:
        position: Each slave id's place in the callback's list (registration order, from 1: the master is 0).
        results: Each slave's reply slot, in registration order.
    """

    __slots__ = ("position", "results")

    def __init__(self, registry: dict[Hashable, SlavePipe]) -> None:
        self.position: dict[Hashable, int] = {ident: k for k, ident in enumerate(registry, 1)}
        self.results: tuple[FutureResult, ...] = tuple(pipe.result for pipe in registry.values())


_EMPTY_ROSTER = _Roster({})


class SyncMaster:
    """Gathers one message per slave, runs a callback on all of them and answers every slave.

    - During replication, every non-master copy calls :meth:`register_slave` and keeps the returned
      :class:`SlavePipe`; the master copy keeps the ``SyncMaster`` ("master" and "slave" are kept as
      public compatibility names).
    - During the forward, the master calls :meth:`run_master` and each slave :meth:`SlavePipe.run_slave`.
      ``master_callback`` receives ``[(0, master_msg), (id_1, msg_1), ...]`` with the slaves in registration
      order (so reductions are deterministic) and returns ``[(0, reply_0), (id_1, reply_1), ...]``: the
      master's own reply first, then exactly one reply per slave, in any order.

    Registering after a round (or after an abort) starts a fresh registry. Pickling keeps only
    the callback, so a deepcopy re-binds a bound-method callback to the copied object.

    Args:
        master_callback: The reduction run by the master once all messages are in.

    Examples:
        >>> import threading
        >>> master = SyncMaster(lambda msgs: [(i, sum(m for _, m in msgs)) for i, _ in msgs])
        >>> pipe = master.register_slave(1)
        >>> out = []
        >>> t = threading.Thread(target=lambda: out.append(pipe.run_slave(2, timeout=10.0)))
        >>> t.start(); master.run_master(1, timeout=10.0), t.join(), out
        (3, None, [3])
    """

    def __init__(self, master_callback: MasterCallback) -> None:
        if not callable(master_callback):
            raise TypeError(f"master_callback must be callable, got {type(master_callback).__name__}")
        self._master_callback = master_callback
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._registry: dict[Hashable, SlavePipe] = {}
        self._roster: _Roster | None = _EMPTY_ROSTER  # None: to be made from the registry
        self._activated = False
        self._abort_exc: BaseException | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"master_callback": self._master_callback}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["master_callback"])  # type: ignore[misc]

    @property
    def nr_slaves(self) -> int:
        """The number of registered slaves."""
        return len(self._registry)

    @property
    def aborted(self) -> bool:
        """Whether :meth:`abort` was called since the last registry reset."""
        return self._abort_exc is not None

    def register_slave(self, identifier: Hashable) -> SlavePipe:
        """Register a slave and return its pipe.

        Args:
            identifier: A hashable id, usually the copy or device index; ``0`` is reserved for the master.

        Returns:
            The :class:`SlavePipe` the slave uses to exchange messages with the master.

        Raises:
            TypeError: If ``identifier`` is not hashable.
            ValueError: If ``identifier`` is ``0`` or already registered.
        """
        try:
            hash(identifier)
        except TypeError:
            raise TypeError(
                f"slave identifier must be hashable, got {type(identifier).__name__}: {identifier!r}"
            ) from None
        if identifier == 0:
            raise ValueError("slave identifier 0 is reserved for the master; use ids other than 0")
        with self._lock:
            if self._activated or self._abort_exc is not None:
                self._reset_locked()
            if identifier in self._registry:
                raise ValueError(f"slave identifier {identifier!r} is already registered")
            pipe = SlavePipe(identifier, self._queue, FutureResult())
            self._registry[identifier] = pipe
            self._roster = None
            return pipe

    def _reset_locked(self) -> None:
        self._registry = {}
        self._roster = _EMPTY_ROSTER
        self._queue = queue.SimpleQueue()
        self._activated = False
        self._abort_exc = None

    def abort(self, exc: BaseException) -> None:
        """Abort the exchange: wake the master and every slave; later waits raise ``SyncAbortedError``.

        Idempotent (the first error wins) and safe to call from any thread.

        Args:
            exc: The original error, kept as the ``__cause__`` of every ``SyncAbortedError``.
        """
        if not isinstance(exc, BaseException):
            raise TypeError(f"abort expects an exception, got {type(exc).__name__}: {exc!r}")
        with self._lock:
            if self._abort_exc is not None:
                return
            self._abort_exc = exc
            pipes = list(self._registry.values())
            q = self._queue
        logger.debug("SyncMaster aborted by %r", exc)
        q.put(_ABORT)
        for pipe in pipes:
            pipe.result.set_exception(exc)

    def _raise_if_aborted(self) -> None:
        exc = self._abort_exc
        if exc is not None:
            raise SyncAbortedError(f"synchronisation aborted: {exc!r}") from exc

    def run_master(self, master_msg: Any, *, timeout: float = DEFAULT_SYNC_TIMEOUT) -> Any:
        """Collect every slave's message, run the callback, answer the slaves and return the master's reply.

        Args:
            master_msg: The master's own message; it is passed first to the callback.
            timeout: Seconds to wait for all slaves' messages.

        Returns:
            The callback's reply for id 0.

        Raises:
            SyncTimeoutError: If some slaves did not send in time; ``missing`` lists them. The master aborts
                first.
            SyncAbortedError: If the exchange was aborted.
            SyncError: If a message came from an unknown or repeated id, or the callback's replies are
                malformed.
            Exception: Whatever the callback raised (after aborting, so the slaves stop waiting).
        """
        limit = check_timeout(timeout)
        deadline = time.monotonic() + limit
        with self._lock:
            self._activated = True
            roster = self._roster
            if roster is None:
                roster = self._roster = _Roster(self._registry)
            q = self._queue
        self._raise_if_aborted()
        intermediates = self._collect(q, roster, (0, master_msg), deadline, limit)
        try:
            own_reply, replies = self._check_replies(self._master_callback(intermediates), roster)
        except BaseException as exc:
            self.abort(exc)
            raise
        for slot, reply in zip(roster.results, replies, strict=True):
            slot.put(reply)
        return own_reply

    def _collect(
        self, q: queue.SimpleQueue[Any], roster: _Roster, own: tuple[int, Any], deadline: float, limit: float
    ) -> list[tuple[Hashable, Any]]:
        """The callback's list: ``own``, then each slave's ``(id, msg)`` as it was queued, in roster order."""
        position = roster.position
        expected = len(position)
        items: list[Any] = [None] * (expected + 1)
        items[0] = own
        received = 0
        while received < expected:
            remaining = deadline - time.monotonic()
            try:
                item = q.get(True, 0.0 if remaining < 0.0 else min(remaining, _WAIT_MAX))
            except queue.Empty:
                missing = [ident for ident, k in position.items() if items[k] is None]
                err = SyncTimeoutError(
                    f"master (id 0) did not hear from slaves {missing!r} within {limit:g} s; "
                    f"{_EQUAL_CALLS_RULE}",
                    missing=missing,
                )
                self.abort(err)
                raise err from None
            if item is _ABORT:
                self._raise_if_aborted()
                continue
            try:
                ident, _ = item
                k = position.get(ident, 0)
            except (TypeError, ValueError):  # not an (id, msg) pair, or an unhashable id: nobody registered
                ident, k = item, 0
            if not k or items[k] is not None:
                what = "an unregistered" if not k else "a repeated"
                err2 = SyncError(
                    f"master received a message from {what} slave id {ident!r:.200} in one round"
                )
                self.abort(err2)
                raise err2
            items[k] = item  # run_slave's own (id, msg) tuple
            received += 1
        return items

    @staticmethod
    def _check_replies(results: Any, roster: _Roster) -> tuple[Any, list[Any]]:
        """The master's reply and the slaves' (in roster order), once the whole reply set is known valid."""
        try:
            pairs = [(ident, reply) for ident, reply in results]
        except (TypeError, ValueError):
            raise SyncError(
                f"master_callback must return a sequence of (identifier, reply) pairs, got {results!r:.200}"
            ) from None
        if not pairs or pairs[0][0] != 0:
            first = pairs[0][0] if pairs else None
            raise SyncError(f"master_callback's first reply must be for the master (id 0), got id {first!r}")
        position = roster.position
        replies: list[Any] = [_NO_REPLY] * len(position)
        for ident, reply in pairs[1:]:
            try:
                k = position.get(ident, 0)
            except TypeError:  # an unhashable id was never registered
                k = 0
            if not k or replies[k - 1] is not _NO_REPLY:
                what = "an unregistered" if not k else "a repeated"
                raise SyncError(f"master_callback returned a reply for {what} slave id {ident!r}")
            replies[k - 1] = reply
        if len(pairs) != len(position) + 1:
            missing = [ident for ident, k in position.items() if replies[k - 1] is _NO_REPLY]
            raise SyncError(f"master_callback returned no reply for slave ids {missing!r}")
        return pairs[0][1], replies
