r"""The c10d transport: calls, replies and remote values as frames on a gloo link per pair of members.

:class:`C10dTransport` is the engine the package docstring (:mod:`pc_distributed.rpc._c10d`) describes, with
its data flow; this is its protocol, and what holds when a peer dies or stalls.

**Frames** (:mod:`pc_distributed.rpc._c10d.frames`): a fixed-size header with the kind, the sender, the call
id, the body's length and the number of parts, then the body (the parts' sizes and the pickle's head) as a
uint8 tensor of its own (a small body rides inside the header), then the parts (large ones alone, small
ones packed into shared messages). The thread that sends a frame (a caller, a worker with a reply) posts its
sends itself, one frame at a time per peer (a lock), so a frame's messages are adjacent on the link and a
peer's frames arrive in the order they were posted. A posted send must stay alive until gloo has made it (a
dropped ``Work`` is a send never made), and posting does not wait for the peer: a request's sends stay with
its call until the reply, which proves they were made (they are then dropped without a wait: no thread wakes
for them); a worker waits for its reply's sends itself; keep-alives, releases, goodbyes and the sends of
calls that end without a reply go to the peer's *lane*, a thread that waits for them in order. No caller is
blocked by a slow or stalled peer.

**The receivers.** Two threads per peer take turns receiving that peer's frames on their link: the thread with
the turn receives the next header, then the body if it did not ride inside the header, then the parts (each
into memory lent by :class:`~.memory.Buffers`, which becomes the storage of the tensors it carries and
is received into again once they are freed). A reply goes to the waiting call. A request is run by the
receiving thread itself when the other thread is waiting for the turn: it hands the turn on first (the next
header's receive, already posted), so the request starts at once on a thread that is running anyway, instead
of waking a worker and waiting for it, and the other thread, woken meanwhile, receives what comes next (a
handler may therefore call back into its caller: the reply comes through the other thread). A request that
comes while the other thread is busy with a request of its own goes to a small pool of worker threads. Nothing
polls: every thread sleeps in a blocking wait that a frame, a queued item or a deadline ends. A receive posted
for one given peer is announced to it at once, so a frame costs one message, not a notification round trip
more; the same holds for the first message of parts of a frame that repeats the sizes of an earlier one (its
receive is posted ahead: :mod:`~.frames`). A receiver posts the next header's receive before it hands a
frame on: posting releases the GIL, and done after the hand-off it would contend for it with the thread just
woken, a context switch each way.

**Why a link per pair** (gloo's ``transport/tcp/unbound_buffer.cc``, ``context.cc``, ``pair.cc``; torch's
``ProcessGroupGloo.cpp``): a failure in gloo is a failure of a whole group.

- ``Work.wait()`` without a timeout is bounded by the group's timeout (gloo's context timeout), and a wait
  that runs out does not just give up: gloo closes every pair of the group ("Application timeout caused pair
  closure"). With one group for all members, one stalled peer would break the calls between all the others. On
  a link, it breaks that link only: the stalled peer is lost, nobody else is.
- A receive from any source (one group for everyone, one receiver thread) is not ended by a peer's death, and
  on some torch releases a peer's death fails it (seen on torch 2.15: "Connection closed by peer" of the dead
  member in a survivor's any-source receive), which would again fail every peer. A receive on a link ends when
  that peer's connection closes, and fails only that peer.
- ``Work.abort`` is not exposed to Python and ``Work.get_future`` is not implemented for gloo's point-to-point
  ops, so a receive ends only by a frame, a closed connection or the link's timeout. This transport never
  passes a timeout to ``wait`` and sends each peer a keep-alive ping when it has sent it nothing for a quarter
  of ``link_timeout``, so a receive from a live peer always ends by a frame in time.
- Dropping a ``Work`` whose operation is still posted is memory-safe in gloo (it holds weak references to the
  buffer), but a send whose ``Work`` is dropped is never performed and the peer would wait for it; so every
  posted send is waited for, or proven made by the reply to it, before its ``Work`` is dropped.

The cost is two receiver threads and a lane per peer in each process, one gloo device (an event-loop thread)
for all the links where torch lets links share one (:func:`pc_distributed._torch_dist.link_devices`; else one
per peer), and one rendezvous per pair at start: fine for the tens of members RPC groups have, not for
thousands.

**Parts are read from the tensors' own memory when they are sent**, which is after the call returns to the
sender's code. A blocking call (:meth:`C10dTransport.call_sync`) sends the arguments' storages as they are:
its caller waits for the reply, which proves they were sent. :meth:`C10dTransport.call` and
:meth:`C10dTransport.remote` return at once, so they send copies (:meth:`~.codec.Encoded.snapshot`)
and the caller may write to its tensors right away. A reply is sent from the result's storages before the
worker takes the next request. A call that times out may still be sent afterwards (its sends stay posted
until the peer takes them or is lost), reading the arguments' memory then: do not write to the arguments of
a blocking call that timed out while the peer may still be receiving them.

**Shutdown** (:meth:`C10dTransport.shutdown`) is a goodbye protocol. New calls are refused; calls in flight
and running handlers get half the time to finish; then a goodbye frame, the last frame to that peer, goes to
every peer not known to be gone. A member receiving a goodbye fails the calls it has pending on the sender
(``ConnectionError``), answers with its own goodbye unless it has sent one, and sends nothing more to it. A
receiver ends once its peer said goodbye or is lost; the lanes, the workers and the housekeeper end on a
sentinel, after what was queued before it; calls still pending fail with ``ConnectionError``. Peers that shut
down at the same time exchange one goodbye each way.

**A dead peer.** Its connection closes as soon as its process is gone: the receive from it and any send to it
fail at once, which marks it lost and fails every call pending on it with ``ConnectionError`` naming it. A
peer that dies mid-frame (header sent, body or parts not) fails their receive the same way. Nothing else is
affected. Shutdown with a dead peer: its goodbye is skipped (it is lost) or fails at once, so shutdown stays
bounded.

**A stalled peer** (alive, not reading: SIGSTOP, a partition): calls to it fail at their own deadline with
``TimeoutError`` naming it; a send to it stays posted in gloo, waited for by its lane; the receive from it
runs out after ``link_timeout``, which closes that link and marks the peer lost, as does the housekeeper when
it has heard nothing from it for ``link_timeout``. A lost peer stays lost for the transport's lifetime.

Trust: messages are pickles, so a process that can join the links (reach the store) can make members run code.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import Mapping
from concurrent.futures import TimeoutError as _FutureTimeout
from typing import Any

import torch

from pc_distributed._checks import int_in_range, optional_timeout, positive_int, positive_seconds
from pc_distributed._errors import format_exception, portable_exception, reraise_remote
from pc_distributed.rpc._c10d.calls import PendingCall, PendingCalls
from pc_distributed.rpc._c10d.codec import Encoded, decode, encode
from pc_distributed.rpc._c10d.frames import (
    BYE,
    CALL,
    ERROR,
    FETCH,
    PING,
    RELEASE,
    REMOTE,
    REQUESTS,
    VALUE,
    HeaderReceive,
    Incoming,
    Posted,
    post_frame,
    post_header,
    receive_body,
    receive_parts,
)
from pc_distributed.rpc._c10d.kept import KeptValues
from pc_distributed.rpc._c10d.lane import Lane
from pc_distributed.rpc._c10d.memory import Buffers
from pc_distributed.rpc._c10d.peer import Peer
from pc_distributed.rpc._c10d.ref import C10dRemoteRef
from pc_distributed.rpc._c10d.workers import STOP, Workers

__all__ = ["C10dTransport"]

logger = logging.getLogger(__name__)

_Request = tuple[int, int, int, int, Incoming | None]  # (sender, kind, call id, aux, message)


class C10dTransport:
    """Calls between the members of a World over a gloo link per pair of members (no torch RPC).

    Every member creates one, after its links exist (the caller makes them with
    :func:`pc_distributed._torch_dist.pair_link`; the transport never initialises torch.distributed). See the
    module docstring for the protocol and what holds when a peer dies or stalls.

    Args:
        links: The link to each other member, by that member's rank: a gloo process group of the two, in which
            the member with the lower rank is rank 0 (no other traffic may use the frames' tags on it,
            :data:`~.frames.HEADER_TAG` and :data:`~.frames.PAYLOAD_TAG`).
        rank: This process's rank among the members.
        names: The members' names, by rank (used in errors).
        timeout: Default seconds of a call (its reply included).
        link_timeout: The timeout the links were created with, in seconds: gloo bounds every receive by it and
            closes the link when one runs out, so keep-alives go to every peer within a quarter of it.
        workers: The most threads of the worker pool running handlers at once (besides them, each peer's
            receiver threads run one request of that peer at a time).

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If ``links`` does not hold one two-member link to each other member with this process at
            the right rank, or ``names`` does not name each member once.

    Examples:
        >>> links = {1: pair_link(store, 0, 1, 30)}  # on member 1: {0: pair_link(store, 1, 0, 30)}
        >>> t = C10dTransport(links, 0, ["a", "b"], link_timeout=30)
        >>> t.call_sync(1, lambda x: x + 1, (41,))  # doctest: +SKIP
        42
    """

    def __init__(
        self,
        links: Mapping[int, Any],
        rank: int,
        names: list[str] | tuple[str, ...],
        *,
        timeout: float = 60.0,
        link_timeout: float,
        workers: int = 8,
    ) -> None:
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"names must be a list of str, got {names!r}")
        size = len(names)
        if len(set(names)) != size:
            raise ValueError(f"names must name each member once, got {list(names)!r}")
        rank = int_in_range("rank", rank, size)
        if not isinstance(links, Mapping):
            raise TypeError(f"links must be a mapping of rank to process group, got {type(links).__name__}")
        if set(links) != set(range(size)) - {rank}:
            raise ValueError(
                f"links must hold one link to each other member ({sorted(set(range(size)) - {rank})}), "
                f"got one to {sorted(links)}"
            )
        for other, link in links.items():
            _check_link(link, rank, other)
        self._timeout = positive_seconds("timeout", timeout)
        self._link_timeout = positive_seconds("link_timeout", link_timeout)
        workers = positive_int("workers", workers)
        self._rank = rank
        self._names = tuple(names)
        self._keepalive = self._link_timeout / 4
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when calls or handlers finish
        now = time.monotonic()
        self._peers = {
            r: Peer(
                r,
                names[r],
                link,
                int(r > rank),
                Lane(f"pc-c10d-lane-{rank}-{r}", functools.partial(self._lose, r)),
                last_sent=now,
                last_heard=now,
            )
            for r, link in sorted(links.items())
        }
        self._ids = itertools.count(1)
        self._pending = PendingCalls()
        self._housekeeper_due = now  # when the housekeeper wakes next, at the latest (it starts at once)
        self._kept = KeptValues()
        self._handlers_running = 0
        self._serving = threading.local()  # .active: this thread runs a handler (see shutdown)
        self._state = "running"  # -> "stopping" -> "stopped"
        self._workers = Workers(workers, f"pc-c10d-worker-{rank}")
        self._completions = Workers(2, f"pc-c10d-done-{rank}")
        self._chores: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._buffers = Buffers()
        for peer in self._peers.values():
            peer.lane.start()
            peer.receivers = [
                threading.Thread(
                    target=self._take_turns,
                    args=(peer, i == 0),
                    name=f"pc-c10d-recv-{rank}-{peer.rank}-{i}",
                    daemon=True,
                )
                for i in range(2)
            ]
            for thread in peer.receivers:
                thread.start()
        self._housekeeper = threading.Thread(
            target=self._housekeep, name=f"pc-c10d-housekeeper-{rank}", daemon=True
        )
        self._housekeeper.start()

    # -- public API ----------------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._rank

    @property
    def names(self) -> tuple[str, ...]:
        """The members' names, by rank."""
        return self._names

    @property
    def is_running(self) -> bool:
        """Whether calls are accepted (False once :meth:`shutdown` began)."""
        return self._state == "running"

    def call(
        self,
        to_rank: int,
        fn: Any,
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> torch.futures.Future[Any]:
        """Run ``fn(*args, **kwargs)`` on member ``to_rank``; a future of its value.

        The future completes with the value, or with the remote exception (original type, the remote
        traceback as ``__cause__``), ``TimeoutError`` after ``timeout`` or ``ConnectionError`` if the member
        is lost or shuts down, both naming it. Its callbacks run on a transport thread: they must not wait
        for another call's future.

        Args:
            to_rank: The member's rank in the group (this process's own rank runs the call here, on a worker,
                on a copy of the arguments).
            fn: What to run (by name, or by value where it has no loadable name: lambdas and closures work).
            args: Positional arguments.
            kwargs: Keyword arguments.
            timeout: Seconds until the reply (None or -1: the transport's default).

        Raises:
            TypeError: If the request cannot be pickled (nothing is sent), or an argument has the wrong type.
            ValueError: If ``to_rank`` is not a rank of the group.
            ConnectionError: If the member is already known to be lost or gone.
            RuntimeError: If the transport is shut down.
        """
        pending = self._start(to_rank, CALL, fn, args, kwargs, timeout, snapshot=True)
        out: torch.futures.Future[Any] = torch.futures.Future()

        def finish() -> None:
            try:
                value = self.call_outcome(pending)
            except BaseException as exc:
                out.set_exception(exc)
            else:
                out.set_result(value)

        def done(_: object) -> None:
            try:
                self._completions.submit(finish)
            except RuntimeError:  # shut down: complete it here
                finish()

        pending.future.add_done_callback(done)
        return out

    def call_sync(
        self,
        to_rank: int,
        fn: Any,
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Any:
        """:meth:`call` and wait for the value (see there for arguments and errors)."""
        pending = self._start(to_rank, CALL, fn, args, kwargs, timeout)
        return self.wait_call(pending)

    def remote(
        self,
        to_rank: int,
        fn: Any,
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> C10dRemoteRef:
        """Run ``fn`` on member ``to_rank`` and keep its value there; a reference to it, returned at once.

        The owner holds the value until the reference is released (:meth:`C10dRemoteRef.release`, or when the
        last Python reference to it is garbage-collected). ``timeout`` bounds the creation; errors of the
        creation surface at :meth:`C10dRemoteRef.to_here` and :meth:`C10dRemoteRef.wait_created`.

        Raises:
            TypeError: If the request cannot be pickled (nothing is sent).
            ValueError: If ``to_rank`` is not a rank of the group.
            ConnectionError: If the member is already known to be lost or gone.
            RuntimeError: If the transport is shut down.
        """
        pending = self._start(to_rank, REMOTE, fn, args, kwargs, timeout, snapshot=True)
        return C10dRemoteRef(self, to_rank, pending.call_id, pending)

    def shutdown(self, timeout: float | None = None, drain: bool = True) -> None:
        """Stop gracefully within ``timeout`` seconds (None or -1: the transport's default); idempotent.

        Refuses new calls, gives the calls in flight and the handlers running half the time to finish (none
        with ``drain`` False: they fail with ``ConnectionError``), says goodbye to every peer, waits for their
        goodbyes (a peer that died is skipped: the send to it fails at once), then fails whatever is still
        pending with ``ConnectionError`` and ends the threads.
        Returns by the deadline even if a peer died or a handler never returns (such a thread is a daemon and
        is logged); the process group itself is the caller's to destroy, after this.

        A handler may call it (a service that stops its World): the drain does not wait for that handler, and
        its reply is not sent (the goodbye went first), so its caller gets ``ConnectionError``.
        """
        seconds = optional_timeout("timeout", timeout)
        deadline = time.monotonic() + (self._timeout if seconds is None else seconds)
        with self._lock:
            if self._state != "running":
                return
            self._state = "stopping"
            # calls in flight and handlers running get half the time; the goodbyes get the rest
            drained = time.monotonic() + (deadline - time.monotonic()) / 2 if drain else 0.0
            # a handler that shuts its own transport down is not waited for
            mine = 1 if getattr(self._serving, "active", False) else 0
            while (self._pending or self._handlers_running > mine) and self._idle.wait(
                max(0.0, drained - time.monotonic())
            ):
                pass
            byes = [p for p in self._peers.values() if not p.said_bye and p.lost is None]
        for peer in byes:
            self._send(peer.rank, BYE, 0)
        for peer in self._peers.values():
            peer.receiver_done.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._state = "stopped"
            leftovers = self._pending.pop_all()
            for call in leftovers:
                self._orphan_locked(call)
            peers = list(self._peers.values())
        for call in leftovers:
            why = "this member shut down first"
            call.fail(ConnectionError(f"{call.what} to {self.member(call.peer)} failed: {why}"))
        for peer in peers:
            peer.lane.stop()  # after the frames before it: a lane ends once they are sent
        self._chores.put(STOP)
        stuck = self._workers.stop(deadline) + self._completions.stop(deadline)
        for peer in peers:
            for thread in (peer.lane.thread, *peer.receivers):
                if thread is not None and thread is not threading.current_thread():
                    thread.join(max(0.0, deadline - time.monotonic()))
                    if thread.is_alive():
                        stuck.append(thread.name)
        self._housekeeper.join(max(0.0, deadline - time.monotonic()))
        self._buffers.close()  # what received tensors still use is unmapped once they are freed
        if stuck:
            logger.warning(
                "c10d transport of %s shut down with threads still running (a receiver waits in gloo until "
                "its peer's goodbye, its connection closing or the link's timeout, %g s): %s",
                self.member(self._rank),
                self._link_timeout,
                stuck,
            )

    # -- calls -----------------------------------------------------------------------------------------------

    def member(self, rank: int) -> str:
        """How errors name member ``rank``."""
        return f"member {self._names[rank]!r} (rank {rank})"

    def _start(
        self,
        to_rank: int,
        kind: int,
        fn: Any,
        args: Any,
        kwargs: Any,
        timeout: float | None,
        *,
        snapshot: bool = False,
    ) -> PendingCall:
        what = "remote" if kind == REMOTE else "call"
        to_rank = int_in_range("to_rank", to_rank, len(self._names))
        seconds = optional_timeout("timeout", timeout)
        seconds = self._timeout if seconds is None else seconds
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"args must be a tuple, got {type(args).__name__}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"kwargs must be a dict or None, got {type(kwargs).__name__}")
        self._check_reachable(to_rank)
        message = encode((fn, tuple(args), dict(kwargs or {})), f"the {what} to {self.member(to_rank)}")
        if snapshot:  # the caller goes on before the parts are sent: they must not see its later writes
            message = message.snapshot()
        return self._register_and_send(to_rank, kind, message, seconds, what, aux=0)

    def _check_reachable(self, to_rank: int) -> None:
        if self._state != "running":
            raise RuntimeError("the c10d transport is shut down")
        peer = self._peers.get(to_rank)
        if peer is not None and peer.lost is not None:
            raise ConnectionError(f"{self.member(to_rank)} is unreachable: {peer.lost}")
        if peer is not None and (peer.heard_bye or peer.said_bye):
            raise ConnectionError(f"{self.member(to_rank)} has shut down")

    def _register_and_send(
        self, to_rank: int, kind: int, message: Encoded | None, seconds: float, what: str, aux: int
    ) -> PendingCall:
        call_id = next(self._ids)
        pending = PendingCall(to_rank, call_id, time.monotonic() + seconds, seconds, what)
        with self._lock:
            self._pending.add(pending)
            sooner = pending.deadline < self._housekeeper_due
            if sooner:
                self._housekeeper_due = pending.deadline
        if sooner:
            self._chores.put(None)  # the housekeeper's next wake-up moves earlier
        self._send(to_rank, kind, call_id, message, aux, pending)
        return pending

    def wait_call(self, pending: PendingCall) -> Any:
        """Wait for ``pending`` until its deadline (then ``TimeoutError``); its value, or its error raised."""
        try:
            pending.future.result(max(0.0, pending.deadline - time.monotonic()))
        except _FutureTimeout:
            self._expire(pending)
        return self.call_outcome(pending)

    def _expire(self, pending: PendingCall) -> None:
        with self._lock:
            if self._pending.pop(pending.call_id) is None:
                return  # answered or failed meanwhile, under this lock: its future is complete
            self._orphan_locked(pending)
            pending.fail(
                TimeoutError(
                    f"{pending.what} to {self.member(pending.peer)} timed out after {pending.timeout:g} s"
                )
            )
            self._idle.notify_all()

    def call_outcome(self, pending: PendingCall) -> Any:
        """The value of an answered call, or its remote exception raised (read once, then kept)."""
        with pending.decode_lock:
            if pending.decoded is None:
                kind, message = pending.future.result(0)
                obj: Any = None
                if message is not None:
                    try:
                        obj = decode(message.head(), message.parts)
                    finally:
                        self._buffers.give(message.body)  # the head is unpickled: the buffer may be reused
                pending.decoded = (kind, obj)
            kind, obj = pending.decoded
        if kind == ERROR:
            exc, text = obj
            raise reraise_remote(exc, text, self.member(pending.peer))
        return obj

    def fetch_value(self, owner: int, ref_id: int, timeout: float | None) -> Any:
        """A copy of the value ``owner`` keeps for our call ``ref_id`` (``timeout``: None, the default)."""
        seconds = optional_timeout("timeout", timeout)
        self._check_reachable(owner)
        pending = self._register_and_send(
            owner, FETCH, None, self._timeout if seconds is None else seconds, "to_here", aux=ref_id
        )
        return self.wait_call(pending)

    def release_value(self, owner: int, ref_id: int) -> None:
        """Tell ``owner`` to drop the value kept for our remote call ``ref_id`` (quietly if it is gone)."""
        if self._state == "stopped":
            return
        if owner == self._rank:
            self._kept.release((self._rank, ref_id))
            return
        self._send(owner, RELEASE, 0, None, ref_id)

    # -- sending ---------------------------------------------------------------------------------------------

    def _send(
        self,
        to_rank: int,
        kind: int,
        call_id: int,
        message: Encoded | None = None,
        aux: int = 0,
        request: PendingCall | None = None,
    ) -> None:
        """Post a frame to ``to_rank`` from this thread (or deliver it here), then see its sends through.

        Posting does not wait for the peer. Who waits for the sends (a dropped ``Work`` is a send never
        made): a request's works stay with its call until the reply, which proves they were sent (then they
        are dropped, no wait), or go to the peer's lane if the call fails first; a reply is waited for here,
        by the worker that made it (bounded by the group's timeout); other frames go to the lane. A frame
        that cannot go is dropped, and a dropped request fails its call with ``ConnectionError``.
        """
        if to_rank == self._rank:
            self._on_frame(
                self._rank, kind, call_id, aux, None if message is None else Incoming.copy_of(message)
            )
            return
        peer = self._peers[to_rank]
        failed: str | None = None
        posted: Posted | None = None
        with peer.post_lock:
            if peer.said_bye or peer.lost is not None:
                failed = peer.lost or "this member said goodbye to it"
            else:
                try:
                    posted = post_frame(
                        peer.link,
                        peer.link_rank,
                        kind,
                        self._rank,
                        call_id,
                        aux,
                        message,
                        predicted=peer.predicted,
                    )
                except RuntimeError as exc:
                    failed = f"a send to it failed ({exc})"
                else:
                    peer.predicted = posted.predicted
                    peer.last_sent = time.monotonic()
                    peer.said_bye = kind == BYE
                    if request is not None:
                        with self._lock:
                            if self._pending.get(call_id) is request:
                                request.sent = (posted, message)
                            elif not request.future.done() or request.future.exception() is not None:
                                peer.lane.wait_for(posted, message)  # failed meanwhile: the lane waits
                    elif kind not in (VALUE, ERROR):
                        peer.lane.wait_for(posted, message, last=kind == BYE)
        if posted is not None and kind in (VALUE, ERROR):
            try:
                posted.wait()
            except RuntimeError as exc:
                failed = f"a send to it failed ({exc})"
        if failed is not None:
            if failed.startswith("a send"):
                self._lose(to_rank, failed)
            if request is not None:
                with self._lock:
                    if self._pending.get(call_id) is request:
                        self._fail_calls_locked([request], failed, to_rank)

    def _orphan_locked(self, pending: PendingCall) -> None:
        """Hand the sends of a call that ends without a reply to its peer's lane, which waits for them."""
        if pending.sent is not None:
            peer = self._peers.get(pending.peer)
            if peer is not None:
                peer.lane.wait_for(*pending.sent)
            pending.sent = None

    # -- receiving -------------------------------------------------------------------------------------------

    def _take_turns(self, peer: Peer, first: bool) -> None:
        """One of ``peer``'s two receiver threads: receive its frames while this thread has the turn.

        The thread with the turn receives; when a request arrives and the other thread waits for the turn, it
        hands the turn on (the next header's receive, already posted) and runs the request itself, so the
        request starts without waking another thread first; then it waits for the turn in its place. A request
        that comes while the other thread is busy with a request of its own goes to the worker pool, and
        receiving stays where it is. Receiving stays with one thread at a time, so frames are taken in the
        order they came.
        """
        posted: HeaderReceive | None = None
        if first:
            try:
                posted = post_header(peer.link, peer.link_rank)
            except Exception as exc:  # torch's RuntimeError: the link is closed
                self._lose(peer.rank, f"receiving from it failed ({exc})")
                self._end_receiving(peer)
                return
        while True:
            if posted is None:
                with self._lock:
                    peer.waiting_turns += 1
                turn = peer.turn.get()  # woken by the turn handed on, or by STOP once receiving has ended
                if turn is STOP:
                    return
                posted = turn
            try:
                request = self._receive(peer, posted)
            except BaseException:
                self._end_receiving(peer)
                raise
            if request is None:
                self._end_receiving(peer)
                return
            posted = None
            self._serve(*request)
            del request  # not kept alive while this thread waits for the turn

    def _end_receiving(self, peer: Peer) -> None:
        """Receiving from ``peer`` has ended: say so, and end its other receiver thread (now or once idle)."""
        peer.receiver_done.set()
        peer.turn.put(STOP)

    def _receive(self, peer: Peer, posted: HeaderReceive) -> _Request | None:
        """Receive ``peer``'s frames, starting with the header of ``posted``, one at a time on its link.

        Returns:
            A request to run on this thread, once the turn is handed on to the other receiver thread; None
            once nothing more comes from the peer (its goodbye, its loss, or a malformed frame).

        The next header's receive is posted before a frame is handed on (:func:`~.frames.post_header`),
        except after a goodbye, which is the peer's last frame.
        """
        while True:
            try:
                # keep-alives end the wait before the link's timeout
                header = posted.take()
            except Exception as exc:  # torch's RuntimeError: the connection closed or the link timed out
                self._lose(peer.rank, f"receiving from it failed ({exc})")
                return None
            if isinstance(header, str) or header.src != peer.rank:
                # Not a frame of ours, or not from this peer: nothing more from it can be trusted.
                self._lose(peer.rank, f"a malformed frame arrived from it ({header})")
                return None
            message: Incoming | str | None = None
            body: torch.Tensor | memoryview | None = header.inline
            try:
                if body is None and header.nbytes:
                    body = receive_body(peer.link, peer.link_rank, header.nbytes, self._buffers)
                if body is not None:
                    message, peer.prediction = receive_parts(
                        peer.link,
                        peer.link_rank,
                        body,
                        header.nparts,
                        self._buffers,
                        peer.prediction,
                        header.predicted,
                    )
                if header.kind != BYE:
                    posted = post_header(peer.link, peer.link_rank, posted)
            except Exception as exc:  # its connection closed mid-frame, or no memory for the message
                self._lose(peer.rank, f"receiving a frame's message from it failed ({exc})")
                return None
            if isinstance(message, str):
                self._lose(peer.rank, f"a malformed frame arrived from it ({message})")
                return None
            if header.kind in REQUESTS:
                peer.last_heard = time.monotonic()
                request = (peer.rank, header.kind, header.call_id, header.aux, message)
                with self._lock:
                    accepted = self._accept_locked(peer.rank, header.kind, header.call_id)
                    hand_on = accepted and peer.waiting_turns > 0
                    if hand_on:
                        peer.waiting_turns -= 1
                if hand_on:
                    peer.turn.put(posted)
                    return request
                if accepted:
                    self._submit(*request)
            else:
                self._on_frame(peer.rank, header.kind, header.call_id, header.aux, message)
            if peer.gone:
                return None  # a posted header receive is dropped with its link (memory-safe in gloo)

    def _on_frame(self, src: int, kind: int, call_id: int, aux: int, message: Incoming | None) -> None:
        """Route one received frame (on the receiver thread, or the sender's for a call to itself)."""
        peer = self._peers.get(src)
        if peer is not None:
            peer.last_heard = time.monotonic()
        if kind in REQUESTS:
            with self._lock:
                accepted = self._accept_locked(src, kind, call_id)
            if accepted:
                self._submit(src, kind, call_id, aux, message)
        elif kind in (VALUE, ERROR):
            with self._lock:
                pending = self._pending.pop(call_id)
                if pending is not None:
                    pending.sent = None  # the reply proves the request's bytes were all sent
                    pending.answer(kind, message)
                    self._idle.notify_all()
        elif kind == RELEASE:
            self._kept.release((src, aux))
        elif kind == BYE and peer is not None:
            with self._lock:
                peer.heard_bye = True
                self._fail_calls_locked(self._pending.to(src), "it has shut down", src)
                answer = not peer.said_bye and peer.lost is None
            if answer:
                self._send(src, BYE, 0)
        # PING: nothing to do beyond last_heard

    def _accept_locked(self, src: int, kind: int, call_id: int) -> bool:
        """Count a request from ``src`` as running, unless our goodbye has gone to it; whether it runs.

        Call under ``self._lock``. A request counted here must then be run (:meth:`_serve`) or given up
        (:meth:`_submit`).
        """
        peer = self._peers.get(src)
        if peer is not None and peer.said_bye:
            return False  # the caller has our goodbye, and with it a ConnectionError for this call
        self._handlers_running += 1
        if kind == REMOTE:
            self._kept.creating((src, call_id))
        return True

    def _submit(self, src: int, kind: int, call_id: int, aux: int, message: Incoming | None) -> None:
        """Run an accepted request on a worker of the pool (queued while all of them are busy)."""
        try:
            self._workers.submit(lambda: self._serve(src, kind, call_id, aux, message))
        except RuntimeError:  # shut down meanwhile: the caller gets our goodbye or times out
            self._kept.abandon((src, call_id))
            with self._lock:
                self._handlers_running -= 1
                self._idle.notify_all()

    def _serve(self, src: int, kind: int, call_id: int, aux: int, message: Incoming | None) -> None:
        """Run one accepted request (on a worker, or on a receiver thread that handed its turn on), reply."""
        key = (src, call_id)
        reply: Encoded | None = None
        self._serving.active = True
        try:
            try:
                if kind == FETCH:
                    value = self._kept.get((src, aux), f"the remote value {aux} of {self.member(src)}")
                else:
                    if message is None:  # pragma: no cover - a request always has a message
                        raise ValueError("a request frame came without its message")
                    try:
                        fn, args, kwargs = decode(message.head(), message.parts)
                    finally:
                        self._buffers.give(message.body)
                    del message
                    value = fn(*args, **kwargs)
                if kind == REMOTE:
                    self._kept.keep(key, value)
                    value = None
                reply_kind = VALUE
                reply = None if value is None else encode(value, f"the result for {self.member(src)}")
            except Exception as exc:
                if kind == REMOTE:
                    self._kept.abandon(key)
                reply_kind = ERROR
                reply = self._error_message(exc)
            self._send(src, reply_kind, call_id, reply)
        finally:
            self._serving.active = False
            with self._lock:
                self._handlers_running -= 1
                self._idle.notify_all()

    @staticmethod
    def _error_message(exc: BaseException) -> Encoded:
        text = format_exception(exc)
        try:
            return encode((portable_exception(exc), text), "the error")
        except Exception:  # an exception that survives pickle but not its copy here
            return encode((RuntimeError(f"{type(exc).__qualname__}: {exc}"), text), "the error")

    def owned_count(self, creator: int | None = None) -> int:
        """How many values this member keeps for remote references (of ``creator`` only, if given)."""
        return self._kept.count(creator)

    def _wait_owned_count(self, count: int, timeout: float, creator: int | None = None) -> bool:
        """Wait until :meth:`owned_count` is ``count``; whether it is (for tests and diagnostics)."""
        return self._kept.wait_count(count, timeout, creator)

    def _wait_lost(self, rank: int, timeout: float) -> str | None:
        """Wait until peer ``rank`` is lost; why it is, or None if it is not (for tests and diagnostics)."""
        peer = self._peers[rank]
        with self._lock:
            self._idle.wait_for(lambda: peer.lost is not None, timeout)
            return peer.lost

    # -- failures --------------------------------------------------------------------------------------------

    def _fail_calls_locked(self, calls: list[PendingCall], why: str, rank: int) -> None:
        for pending in calls:
            self._pending.pop(pending.call_id)
            self._orphan_locked(pending)
            pending.fail(ConnectionError(f"{pending.what} to {self.member(rank)} failed: {why}"))
        if calls:
            self._idle.notify_all()

    def _lose(self, rank: int, why: str) -> None:
        """Mark ``rank`` unreachable: fail its calls, drop the values kept for it, end its lane."""
        with self._lock:
            peer = self._peers.get(rank)
            if peer is None or peer.lost is not None:
                return
            peer.lost = why
            self._fail_calls_locked(self._pending.to(rank), f"it is unreachable: {why}", rank)
            lane = peer.lane
            self._idle.notify_all()
        self._kept.forget(rank)
        logger.warning(
            "c10d transport of %s: %s is unreachable: %s", self.member(self._rank), self.member(rank), why
        )
        lane.stop()

    # -- housekeeping ----------------------------------------------------------------------------------------

    def _housekeep(self) -> None:
        """Keep-alives, call deadlines and queued releases, until shutdown's sentinel."""
        while True:
            now = time.monotonic()
            with self._lock:
                due = now + self._keepalive
                for p in self._peers.values():
                    if not p.said_bye and p.lost is None:
                        due = min(due, p.last_sent + self._keepalive)
                        if not p.heard_bye:
                            due = min(due, p.last_heard + self._link_timeout)
                deadline = self._pending.next_deadline()
                if deadline is not None:
                    due = min(due, deadline)
                self._housekeeper_due = due
            try:
                item = self._chores.get(timeout=max(0.0, due - now))  # a chore, or the next due time
            except queue.Empty:
                item = None
            if item is STOP:
                return
            if isinstance(item, tuple):
                self.release_value(*item)
            self._expire_due(time.monotonic())
            self._keep_alive(time.monotonic())

    def _expire_due(self, now: float) -> None:
        with self._lock:
            expired = self._pending.due(now)
        for pending in expired:
            self._expire(pending)

    def _keep_alive(self, now: float) -> None:
        with self._lock:
            if self._state == "stopped":
                return
            quiet = [p for p in self._peers.values() if not p.said_bye and p.lost is None]
        for peer in quiet:
            if not peer.heard_bye and now - peer.last_heard > self._link_timeout:
                self._lose(
                    peer.rank,
                    f"it sent nothing for {now - peer.last_heard:.1f} s "
                    f"(link_timeout {self._link_timeout:g} s)",
                )
            elif now - peer.last_sent >= self._keepalive:
                self._send(peer.rank, PING, 0)

    def release_value_later(self, owner: int, ref_id: int) -> None:
        """Queue :meth:`release_value` for the housekeeper (safe from a garbage-collector callback)."""
        self._chores.put((owner, ref_id))

    def __reduce__(self) -> Any:
        raise TypeError("a C10dTransport belongs to its process and cannot be pickled")


def _check_link(link: Any, rank: int, other: int) -> None:
    """Check that ``link`` is a two-member process group in which this process has the expected rank."""
    if not all(callable(getattr(link, name, None)) for name in ("send", "recv", "rank", "size")):
        kind = type(link).__name__
        raise TypeError(f"links[{other}] must be a torch.distributed process group, got {kind}")
    expected = int(rank > other)
    if link.size() != 2 or link.rank() != expected:
        raise ValueError(
            f"links[{other}] must be a group of two in which this member ({rank}) is rank {expected}, got "
            f"a group of {link.size()} in which it is rank {link.rank()}"
        )
