"""The TensorPipe RPC backend: ``torch.distributed.rpc``'s public calls as a :class:`~._backend.RpcBackend`.

Start-up (the bounded ``init_rpc``) and shutdown (bounded, a failed graceful shutdown falling back to a
non-graceful one) are here, over the thin torch-facing calls of :mod:`pc_distributed._torch_dist`
(TensorPipe's options, ``init_rpc``, ``rpc.shutdown``); the calls themselves are torch's public ``rpc_async``
and ``remote``, looked up on ``torch.distributed.rpc`` at each call. A remote value is torch's
``RRef``, behind :class:`TensorPipeValue`.

**Every wait is pc's, bounded by the call's own timeout.** TensorPipe completes a call's future on the
agent's thread pool (16 threads by default), the pool that also runs the incoming calls; that holds for the
reply and for the error its timeout thread raises when a call's timeout runs out. When every thread of the
pool runs a handler that itself waits for a call (a chain of nested calls between members deeper than the
pool, or many threads each starting a short chain), no thread is left to complete any future: neither the
replies nor torch's timeouts reach their waiters, and every call of the chain waits forever. So no wait here
is torch's::

    call_sync  rpc_async ──> torch future ── done callback (a pool thread) ──> queue ─┐
               wait on the queue until the call's deadline <─────────────────────────┘ else TimeoutError
    call       rpc_async ──> torch future ── done callback ──┐
               pc's future <── settled once ─────────────────┤
                                    _Deadlines thread at the deadline: TimeoutError
    remote     rpc.remote ──> TensorPipeValue: to_here runs torch's on a helper thread, waited at most its
               timeout

A handler waiting for a call of its own gives up at that call's deadline, which frees its pool thread: the
pool drains and later calls work again. torch is given the same timeout, so whichever notices first ends the
call; both are a ``TimeoutError`` naming the member.
"""

from __future__ import annotations

import heapq
import io
import itertools
import logging
import pickle
import queue
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.rpc as rpc

from pc_distributed import _torch_dist
from pc_distributed._bounded import call_bounded
from pc_distributed.rpc._backend import BackendSetup

__all__ = ["TensorPipeBackend", "TensorPipeValue"]

logger = logging.getLogger(__name__)


def _no_reply(to: str, timeout: float) -> str:
    return (
        f"no reply from {to!r} within {timeout:g} s (it is busy, stalled or gone, or all of its RPC threads "
        "wait for calls of their own)"
    )


class TensorPipeBackend:
    """RPC over ``torch.distributed.rpc`` with TensorPipe: the process-wide RPC agent of torch.

    Create it with :meth:`start` (one per process: torch's agent is global). Errors: ``TimeoutError`` when
    a call's deadline passes without a reply (see the module), else torch's (``RuntimeError`` for a timeout
    or a lost peer, which the RPC layer maps by message; pickling errors of the payload raised by the call
    itself).

    Args:
        timeout: Default seconds of a fetch (``to_here()`` without a timeout): the agent's default.
    """

    name = "tensorpipe"

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._deadlines = _Deadlines()

    @staticmethod
    def missing() -> str | None:
        """Why this torch cannot run TensorPipe (a build without ``torch.distributed.rpc``), or None."""
        return None if _torch_dist.rpc_available() else "this torch build has no torch.distributed.rpc"

    @classmethod
    def start(cls, setup: BackendSetup) -> TensorPipeBackend:
        """Start torch's RPC as ``setup.member`` on ``setup.rpc_init_method()``, within the start timeout.

        Calls default to ``setup.timeout`` seconds; ``setup.busy_poll`` offers TensorPipe's busy-polling
        transports (see ``_torch_dist.rpc_options``). The start-up (RPC's rendezvous on the store and
        TensorPipe's exchange of the workers' names) must finish within ``setup.start_timeout`` plus
        ``WAIT_GRACE`` seconds.

        Raises:
            TimeoutError: If the start-up does not finish in time.
        """
        url = setup.rpc_init_method()
        options = _torch_dist.rpc_options(url, setup.timeout, setup.busy_poll)
        _torch_dist.bounded_here(
            lambda: _torch_dist.init_rpc(setup.member, setup.rank, setup.world_size, options),
            setup.start_timeout,
            f"RPC start-up of {setup.member!r} on {url}",
        )
        return cls(setup.timeout)

    def plain_pickles(self, value: Any) -> bool:
        """Whether torch's RPC pickler takes ``value``: plain pickle, with tensors and RRefs set aside.

        One pickling pass over the value with its tensors left out (no tensor bytes are copied).
        """
        try:
            _Probe(io.BytesIO()).dump(value)
        except Exception:
            return False
        return True

    def call_sync(
        self,
        to: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        timeout: float,
    ) -> Any:
        """``rpc.rpc_async`` of ``fn`` on ``to``, waited for here until the call's deadline.

        Raises:
            TimeoutError: If no reply (nor torch's own timeout) came within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        raw = rpc.rpc_async(to, fn, args=args, kwargs=kwargs, timeout=timeout)
        # the callback is the queue's C method (no Python frame on torch's thread): the cheapest wake-up
        arrived: queue.SimpleQueue[Any] = queue.SimpleQueue()
        raw.add_done_callback(arrived.put)
        try:
            arrived.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(_no_reply(to, timeout)) from None
        return raw.wait()

    def call(
        self,
        to: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        timeout: float,
    ) -> torch.futures.Future[Any]:
        """``rpc.rpc_async`` of ``fn`` on ``to``: a future completed by torch's, or failed at the deadline.

        The future fails with ``TimeoutError`` once ``timeout`` seconds passed without torch completing its
        own, and with ``ConnectionError`` if the backend shuts down first. Its callbacks run on a thread of
        torch's pool, or on a thread of their own when pc ends the call.
        """
        deadline = time.monotonic() + timeout
        raw: torch.futures.Future[Any] = rpc.rpc_async(to, fn, args=args, kwargs=kwargs, timeout=timeout)
        pending = _Pending(to, timeout)
        key = self._deadlines.arm(deadline, pending)

        def forward(fut: torch.futures.Future[Any]) -> None:
            self._deadlines.disarm(key)
            try:
                value = fut.wait()
            except BaseException as exc:  # torch's error, mapped by the RPC layer
                pending.settle(error=exc)
            else:
                pending.settle(value=value)

        raw.add_done_callback(forward)
        return pending.future

    def remote(
        self,
        to: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        timeout: float,
    ) -> TensorPipeValue:
        """``rpc.remote`` of ``fn`` on ``to``: torch's ``RRef`` in a :class:`TensorPipeValue`."""
        return TensorPipeValue(
            rpc.remote(to, fn, args=args, kwargs=kwargs, timeout=timeout), to, self._timeout
        )

    def shutdown(self, graceful: bool, timeout: float) -> None:
        """Shut torch's RPC down within ``timeout`` (a failed graceful shutdown warns and falls back).

        Futures of calls still pending then fail with ``ConnectionError``.
        """
        try:
            _shutdown_agent(graceful, timeout)
        finally:
            self._deadlines.close()

    def __repr__(self) -> str:
        return "TensorPipeBackend()"


def _shutdown_agent(graceful: bool, timeout: float) -> None:
    """Shut torch's RPC down within ``timeout``; a failed graceful shutdown falls back to a non-graceful one.

    A graceful shutdown without a timeout hangs forever when a peer died, so there is always one. Either kind
    then joins the RPC agent's threads, which never ends when it is called from one of them (a handler that
    stops its World): so each runs on a helper thread and is given ``timeout`` (the graceful one, whose own
    timeout bounds only the wait for the peers, twice that). One that has not ended by then is left to end in
    the background (once that handler returns) with a ``RuntimeWarning``.
    """
    if graceful:
        try:
            call_bounded(
                lambda: _torch_dist.shutdown_rpc_agent(True, timeout),
                2 * timeout,
                "torch's graceful RPC shutdown",
            )
            return
        except TimeoutError as exc:
            _warn_left_running(exc)
            return
        except Exception as exc:
            warnings.warn(
                f"graceful RPC shutdown failed ({type(exc).__name__}: {exc}); shutting down non-gracefully",
                RuntimeWarning,
                stacklevel=4,  # World.stop's caller (through the backend's shutdown)
            )
    try:
        call_bounded(
            lambda: _torch_dist.shutdown_rpc_agent(False, timeout),
            timeout,
            "torch's non-graceful RPC shutdown",
        )
    except TimeoutError as exc:
        _warn_left_running(exc)
    except Exception as exc:  # pragma: no cover - torch refuses a second shutdown on some versions
        logger.debug("non-graceful RPC shutdown raised %r", exc)


def _warn_left_running(exc: TimeoutError) -> None:
    warnings.warn(
        f"{exc}; it goes on in the background: torch joins the RPC agent's threads, and World.stop was "
        "probably called from one of them (an RPC handler), which it waits for until it returns",
        RuntimeWarning,
        stacklevel=5,  # World.stop's caller
    )


class TensorPipeValue:
    """torch's ``RRef`` whose :meth:`to_here` is bounded by its timeout (a :class:`~._backend.RemoteValue`).

    torch's ``to_here`` waits for a future that the agent's pool completes (see the module), so it runs on a
    helper thread and is waited for at most its timeout. Every other attribute is the ``RRef``'s.

    Args:
        rref: torch's ``RRef``.
        owner_name: The owner's member name (for messages).
        timeout: Seconds of a fetch without a timeout of its own (the World's ``rpc_timeout``).
    """

    def __init__(self, rref: Any, owner_name: str, timeout: float) -> None:
        self.rref = rref
        self._owner_name = owner_name
        self._timeout = timeout

    def to_here(self, timeout: float | None = None) -> Any:
        """A copy of the value, fetched within ``timeout`` seconds (None: the default).

        Raises:
            TimeoutError: If the value has not arrived in time.
            RuntimeError: torch's error (its own timeout, a lost owner, a failed creation).
        """
        seconds = self._timeout if timeout is None else timeout
        return call_bounded(lambda: self.rref.to_here(seconds), seconds, f"the value on {self._owner_name!r}")

    def is_owner(self) -> bool:
        """Whether this process keeps the value."""
        return bool(self.rref.is_owner())

    def owner(self) -> Any:
        """The owner's ``WorkerInfo`` (torch's)."""
        return self.rref.owner()

    def confirmed_by_owner(self) -> bool:
        """Whether the owner has confirmed the reference."""
        return bool(self.rref.confirmed_by_owner())

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in {"rref", "_owner_name", "_timeout"}:
            raise AttributeError(name)
        return getattr(self.rref, name)

    def __repr__(self) -> str:
        return f"TensorPipeValue({self.rref!r})"


class _Pending:
    """A call handed out as pc's own future: settled once, by torch's future or by pc at the deadline."""

    def __init__(self, to: str, timeout: float) -> None:
        self.future: torch.futures.Future[Any] = torch.futures.Future()
        self.to = to
        self.timeout = timeout
        self._lock = threading.Lock()
        self._settled = False

    def settle(self, value: Any = None, error: BaseException | None = None) -> None:
        """Complete the future with ``value`` or ``error``, unless it is complete already."""
        with self._lock:
            if self._settled:
                return
            self._settled = True
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(value)

    def expire(self) -> None:
        """Fail the call: its deadline passed."""
        self.settle(error=TimeoutError(_no_reply(self.to, self.timeout)))

    def abandon(self) -> None:
        """Fail the call: the backend shut down while it was pending."""
        self.settle(error=ConnectionError(f"the call to {self.to!r} was pending when RPC shut down"))


class _Deadlines:
    """Fails the futures of calls still pending at their deadline: one daemon thread, started when needed.

    Each failure runs on a thread of its own, since completing a future runs its callbacks (the caller's
    code, which may wait): one slow callback must not hold up the deadlines of other calls. A call that is
    answered is disarmed; its heap entry is dropped when it comes up (or when stale entries pile up).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._armed: dict[int, _Pending] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    def arm(self, deadline: float, pending: _Pending) -> int:
        """Fail ``pending`` at ``deadline`` (``time.monotonic()``) unless disarmed first; its key."""
        key = next(self._ids)
        with self._cond:
            if self._closed:
                closed = True
            else:
                closed = False
                self._armed[key] = pending
                heapq.heappush(self._heap, (deadline, key))
                if len(self._heap) > 2 * len(self._armed) + 64:  # mostly answered calls: drop them
                    self._heap = [entry for entry in self._heap if entry[1] in self._armed]
                    heapq.heapify(self._heap)
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="pc-distributed-tensorpipe-deadlines", daemon=True
                    )
                    self._thread.start()
                elif self._heap[0][1] == key:
                    self._cond.notify()  # the earliest deadline moved earlier
        if closed:
            pending.abandon()
        return key

    def disarm(self, key: int) -> None:
        """The call of ``key`` ended: it is not failed at its deadline."""
        with self._cond:
            self._armed.pop(key, None)

    def close(self) -> None:
        """Stop the thread; fail every call still armed with ``ConnectionError`` (idempotent)."""
        with self._cond:
            self._closed = True
            left = list(self._armed.values())
            self._armed.clear()
            self._heap.clear()
            self._cond.notify()
        for pending in left:
            pending.abandon()

    def _run(self) -> None:
        while True:
            with self._cond:
                due: list[_Pending] = []
                while not due:
                    if self._closed:
                        return
                    now = time.monotonic()
                    while self._heap and (self._heap[0][0] <= now or self._heap[0][1] not in self._armed):
                        _, key = heapq.heappop(self._heap)
                        pending = self._armed.pop(key, None)
                        if pending is not None:
                            due.append(pending)
                    if not due:
                        # idle until a call is armed or close(); else until the earliest deadline
                        self._cond.wait(self._heap[0][0] - now if self._heap else None)
            for pending in due:
                threading.Thread(
                    target=pending.expire, name="pc-distributed-tensorpipe-expire", daemon=True
                ).start()


class _Probe(pickle.Pickler):
    """Plain pickle that leaves out what torch's RPC pickler sends its own way (tensors, RRefs)."""

    def persistent_id(self, obj: Any) -> int | None:
        return 0 if isinstance(obj, (torch.Tensor, rpc.RRef)) else None
