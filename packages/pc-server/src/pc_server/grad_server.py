"""The gradient server: a two-level reduction tree that applies client gradients to a managed model.

::

    clients --push (1 RPC)--> secondary reducer k  [queue: B pushes, or the oldest waited flush_timeout]
                                   | per-version partial sums (sum, count), stale groups pre-filtered
                                   v  (1 RPC from the reducer thread, never from a handler)
                              primary reducer      [queue: B forwards, same trigger]
                                   | drop groups with head - v > max_staleness; sum or count-weighted mean
                                   v
                              managed model: p.grad = g; optimizer.step(); lr_scheduler.step(); version += 1
                                   | CPU snapshot, compare-and-set
                                   v
                              ordered server  <--pull (1 RPC, state only when newer)-- clients

With full batches the primary steps once per ``reduce_batch_size ** 2`` pushes. Every member that constructs
an Impl and is a secondary must ``start()`` it (``grad_server_helper`` does), otherwise gradients routed there
wait.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from pc_server._batch_queue import BatchQueue
from pc_server._forward import deliver_forward, register_primary
from pc_server._group import GroupLike, call_member, check_group, check_name
from pc_server._packing import Packed, pack, unpack
from pc_server._reduce import (
    Partial,
    check_reduce_method,
    drop_stale,
    finalize,
    merge_partials,
    reduce_pushes,
)
from pc_server._state import check_model, model_snapshot, set_pp_version
from pc_server.errors import ReducerStoppedError, ReducerTraceback
from pc_server.grad_client import (
    LEDGER_LEVEL,
    REDUCE_MASTER,
    REDUCE_SLAVE,
    GradMessage,
    PushPullGradServer,
    reducer_service_name,
)
from pc_server.ledger import GradLedger, LedgerBook
from pc_server.ordered_server import OrderedServerBase, OrderedServerSimple, OrderedServerSimpleImpl

__all__ = ["GradServerStats", "PushPullGradServerImpl"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class GradServerStats:
    """Counters of one reducer process (a snapshot; see :meth:`PushPullGradServerImpl.stats`).

    The per-client account of every push is :meth:`PushPullGradServerImpl.ledger`.

    Attributes:
        received: Client pushes accepted (queued) here (as a secondary).
        duplicates: Client pushes recognised as a retry of a received ``(client, seq)``.
        dropped_stale: Pushes refused or dropped because their version was more than ``max_staleness`` behind.
        dropped_overflow: Queue items (a push, or a forwarded bundle) dropped because a queue exceeded
            ``max_queue_size``.
        forwarded: Partial-sum bundles sent to the primary.
        steps: Optimizer steps taken (primary).
        applied: Client pushes contained in those steps (primary).
        version: The managed model's version (primary; else the newest version this secondary has heard of).
    """

    received: int = 0
    duplicates: int = 0
    dropped_stale: int = 0
    dropped_overflow: int = 0
    forwarded: int = 0
    steps: int = 0
    applied: int = 0
    version: int = 0


class _Queued(NamedTuple):
    version: int
    grads: Packed
    enqueued: float
    client: str


class _Forward(NamedTuple):
    """A secondary's bundle: version -> (packed gradient sums, push count, pushes per client)."""

    partials: dict[int, tuple[Packed, int, dict[str, int]]]


class _Done(NamedTuple):
    """A secondary's last message from ``stop()``: it forwarded everything it held."""

    member: str


def _per_client(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for c in counts:
        total.update(c)
    return dict(total)


def _forward_clients(forward: _Forward) -> dict[str, int]:
    return _per_client(clients for _sums, _n, clients in forward.partials.values())


def _check_positive_int(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int >= 1, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{what} must be an int >= 1, got {value}")
    return value


def _check_timeout(what: str, value: object, allow_none: bool) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isnan(value):
        raise ValueError(f"{what} must be a number > 0{' or None' if allow_none else ''}, got {value!r}")
    return float(value)


class PushPullGradServerImpl:
    """A parameter server that synchronises a model by pushing gradients and pulling back parameters.

    Construct it on the primary reducer and on every secondary reducer (all members of ``group``), then call
    :meth:`manage_model` on the primary and :meth:`start` everywhere. The primary pairs a
    :class:`~pc_server.PushPullGradServer` accessor under ``server_name``. No strict order is guaranteed:
    pushes return once queued and are applied in a later batch.

    Warning:
        ``DistributedDataParallel`` models are not supported (the state dict is loaded after creation).

    Args:
        server_name: Name of this server, used to pair the accessor in ``group``.
        group: The RpcGroup of the reducers.
        model_name: The model's key in the ordered server.
        primary_reducer: The process that steps the optimizer; default: the first (sorted) group member.
        secondary_reducers: The processes clients push to; default: every group member.
        o_server: A custom ordered server accessor; default: an ordered server hosted on the primary as
            ``server_name + "_o_server"``.
        reduce_method: ``"sum"`` or ``"mean"`` (weighted by push counts, exact for partial batches).
        reduce_device: Where reductions run.
        reduce_batch_size: Items per reduction batch, at both levels.
        max_queue_size: Queue bound; beyond it the oldest items are dropped (counted, warned once).
        flush_timeout: Seconds after which a partial batch is reduced anyway (``None``: never, as machin).
        max_staleness: Drop gradients computed on a version more than this many steps behind the newest
            (``None``: unbounded, as machin).

    Raises:
        TypeError: Wrong argument types.
        ValueError: Bad values (unknown reducers, a non-positive batch size, ``max_queue_size`` smaller than
            the batch size, this process being neither primary nor secondary, ...).
    """

    REDUCE_MASTER = REDUCE_MASTER
    """Service level of a secondary-to-primary forward (machin's name)."""
    REDUCE_SLAVE = REDUCE_SLAVE
    """Service level of a client-to-secondary push (machin's name)."""

    def __init__(
        self,
        server_name: str,
        group: GroupLike,
        model_name: str = "model",
        primary_reducer: str | None = None,
        secondary_reducers: list[str] | None = None,
        o_server: OrderedServerBase | None = None,
        reduce_method: str = "sum",
        reduce_device: torch.device | str = "cpu",
        reduce_batch_size: int = 4,
        max_queue_size: int = 64,
        *,
        flush_timeout: float | None = 1.0,
        max_staleness: int | None = None,
    ) -> None:
        self.server_name = check_name("server_name", server_name)
        self.group = check_group(group)
        self.model_name = check_name("model_name", model_name)
        self.reduce_method = check_reduce_method(reduce_method)
        self.reduce_device = torch.device(reduce_device)
        self.reduce_batch_size = _check_positive_int("reduce_batch_size", reduce_batch_size)
        self.max_queue_size = _check_positive_int("max_queue_size", max_queue_size)
        if self.max_queue_size < self.reduce_batch_size:
            raise ValueError(
                f"max_queue_size ({max_queue_size}) must be >= reduce_batch_size ({reduce_batch_size})"
            )
        self.flush_timeout = _check_timeout("flush_timeout", flush_timeout, allow_none=True)
        if max_staleness is not None and (
            isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0
        ):
            raise ValueError(f"max_staleness must be an int >= 0 or None, got {max_staleness!r}")
        self.max_staleness = max_staleness

        members = list(group.get_group_members())
        self._me = group.get_cur_name()
        self.primary_reducer = (
            members[0] if primary_reducer is None else check_name("primary_reducer", primary_reducer)
        )
        if secondary_reducers is None:
            secondary_reducers = members
        if not isinstance(secondary_reducers, (list, tuple)) or not secondary_reducers:
            raise ValueError(
                f"secondary_reducers must be a non-empty list of names, got {secondary_reducers!r}"
            )
        self.secondary_reducers = [check_name("secondary reducer", m) for m in secondary_reducers]
        if len(set(self.secondary_reducers)) != len(self.secondary_reducers):
            raise ValueError(f"secondary_reducers has duplicates: {self.secondary_reducers}")
        unknown = [m for m in [self.primary_reducer, *self.secondary_reducers] if m not in members]
        if unknown:
            raise ValueError(f"reducers {unknown} are not members of the group (members: {members})")
        self.is_primary = self._me == self.primary_reducer
        self.is_secondary = self._me in self.secondary_reducers
        if not (self.is_primary or self.is_secondary):
            raise ValueError(
                f"process {self._me!r} is neither the primary reducer ({self.primary_reducer!r}) nor a "
                f"secondary ({self.secondary_reducers}); construct the Impl on reducers only"
            )

        self._o_server_impl: OrderedServerSimpleImpl | None = None
        if o_server is None:
            o_name = server_name + "_o_server"
            if self.is_primary:
                self._o_server_impl = OrderedServerSimpleImpl(o_name, group)
            o_server = OrderedServerSimple(o_name, group)
        if not isinstance(o_server, OrderedServerBase):
            raise TypeError(f"o_server must be an OrderedServerBase accessor, got {type(o_server).__name__}")
        self.o_server = o_server

        self._lock = threading.Lock()  # guards the counters, the dedup table and the lifecycle flags
        self._stepped = threading.Condition(self._lock)  # notified after every optimizer step and on failure
        self._stats = GradServerStats()  # forwarded and steps; the push counts live in the ledger
        self._ledger = LedgerBook()
        self._last_seq: dict[str, tuple[int, bool]] = {}  # client -> (last seq, whether it was accepted)
        # role -> per-client pushes in the batch being reduced (booked as dropped_error if the thread fails)
        self._inflight: dict[str, dict[str, int]] = {}
        self._done_secondaries: set[str] = set()  # on the primary: secondaries whose stop() finished
        self._schema: tuple[tuple[str, ...], tuple[tuple[int, ...], ...]] | None = None
        self._known_head = 0
        self._error: BaseException | None = None
        self._error_text = ""
        self._started = False
        self._stopped = False
        self._threads: list[threading.Thread] = []
        self._secondary_q: BatchQueue[_Queued] = BatchQueue(
            self.max_queue_size,
            f"{server_name} secondary queue",
            on_drop=lambda item: self._ledger.record("dropped_overflow", {item.client: 1}),
        )
        self._primary_q: BatchQueue[tuple[_Forward, float]] = BatchQueue(
            self.max_queue_size,
            f"{server_name} primary queue",
            on_drop=lambda item: self._ledger.record("dropped_overflow", _forward_clients(item[0])),
        )
        self.model: nn.Module | None = None
        self.optimizer: Any = None
        self.lr_scheduler: Any = None
        self._version = 0
        group.register(reducer_service_name(server_name, self._me), self._push_service)
        if self.is_primary:
            # secondaries forward by member name through deliver_forward: no service-directory look-up
            register_primary(group.get_group_name(), server_name, self._receive_forward)
            group.pair(
                server_name,
                PushPullGradServer(
                    server_name,
                    group,
                    self.model_name,
                    self.secondary_reducers,
                    self.o_server,
                    self.primary_reducer,
                ),
            )

    # ------------------------------------------------------------------ lifecycle
    def manage_model(self, model: nn.Module, optimizer: Any, lr_scheduler: Any = None) -> None:
        """Let the primary reducer manage ``model`` (call before :meth:`start`).

        The model stays on its device; the published version 0 is a CPU snapshot of it. Each step sets
        ``p.grad`` to the reduced gradient (cast to ``p``'s device and dtype), calls ``optimizer.step()`` and
        then ``lr_scheduler.step()`` when given.

        Warning:
            Use a model that is not also trained directly by your algorithm (e.g. a separate copy in A3C).

        Args:
            model: The model to manage.
            optimizer: An optimizer over ``model``'s parameters (anything with ``step()``).
            lr_scheduler: Optional scheduler with ``step()``, stepped after every optimizer step.

        Raises:
            RuntimeError: This process is not the primary reducer, or the server already started.
            TypeError: Bad argument types.
        """
        if not self.is_primary:
            raise RuntimeError(
                f"process {self._me!r} is not the primary reducer ({self.primary_reducer!r}) "
                "and cannot manage the model"
            )
        if self._started:
            raise RuntimeError("manage_model() must be called before start()")
        check_model(model)
        if not callable(getattr(optimizer, "step", None)):
            raise TypeError(f"optimizer must have a step() method, got {type(optimizer).__name__}")
        if lr_scheduler is not None and not callable(getattr(lr_scheduler, "step", None)):
            raise TypeError(f"lr_scheduler must have a step() method, got {type(lr_scheduler).__name__}")
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self._version = 0
        set_pp_version(model, 0)
        if not self._publish(model_snapshot(model), 0, None):
            raise RuntimeError(
                f"ordered server already holds {self.model_name!r}: another writer published it first"
            )

    def start(self) -> None:
        """Start this process's reducer threads (idempotent).

        Raises:
            RuntimeError: On the primary, :meth:`manage_model` was not called; or the server was stopped.
        """
        with self._lock:
            if self._stopped:
                raise ReducerStoppedError(
                    f"gradient server {self.server_name!r} was stopped and cannot restart"
                )
            if self._started:
                return
            if self.is_primary and self.model is None:
                raise RuntimeError("call manage_model() on the primary reducer before start()")
            self._started = True
            if self.is_secondary:
                self._threads.append(self._spawn("secondary", self._secondary_loop))
            if self.is_primary:
                self._threads.append(self._spawn("primary", self._primary_loop))

    def stop(self, timeout: float | None = None, *, secondaries_timeout: float = 10.0) -> None:
        """Stop accepting pushes, reduce what is queued, and join the reducer threads (idempotent).

        The secondary drains first (forwarding its partial sums) and then tells the primary it is done; the
        primary waits up to ``secondaries_timeout`` seconds for every other secondary to be done before it
        drains and applies what it holds. So every reducer may call ``stop()`` at the same time; a secondary
        that stops later than that finds the primary gone and books its last pushes as ``dropped_shutdown``
        in the :meth:`ledger` (with a warning).

        Args:
            timeout: Seconds to wait for each thread; ``None`` waits until they finish draining.
            secondaries_timeout: On the primary, seconds to wait for the other secondaries to finish
                (woken by each one's final message); ``0`` does not wait.

        Raises:
            TimeoutError: A reducer thread did not finish within ``timeout`` (named in the message).
        """
        with self._lock:
            self._stopped = True
        self._stop_role(self._secondary_q, "secondary", timeout)
        if self.is_secondary and not self.is_primary:
            self._say_done()
        if self.is_primary:
            self._wait_for_secondaries(secondaries_timeout)
        self._stop_role(self._primary_q, "primary", timeout)

    def _stop_role(self, queue: BatchQueue[Any], role: str, timeout: float | None) -> None:
        queue.close()
        threads = [t for t in self._threads if t.name.endswith(role)]
        for thread in threads:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(
                    f"gradient server {self.server_name!r}: the {role} reducer on {self._me!r} did not stop "
                    f"within {timeout} s"
                )
        if not threads:  # never started: nothing will reduce what was queued; book it
            left = queue.drain()
            clients = [
                {item.client: 1} if isinstance(item, _Queued) else _forward_clients(item[0]) for item in left
            ]
            n = self._ledger.record("dropped_shutdown", _per_client(clients))
            if n:
                logger.warning(
                    "gradient server %r: the %s reducer on %r was never started; dropping %d queued pushes",
                    self.server_name,
                    role,
                    self._me,
                    n,
                )

    def _say_done(self) -> None:
        """Tell the primary this secondary forwarded everything (it may stop now)."""
        try:
            self._forward(_Done(self._me), 0.0)  # type: ignore[arg-type]
        except (ReducerStoppedError, ConnectionError, TimeoutError, KeyError) as exc:
            logger.debug(
                "gradient server %r: primary not told %r is done: %r", self.server_name, self._me, exc
            )

    def _wait_for_secondaries(self, timeout: float) -> None:
        others = set(self.secondary_reducers) - {self._me}
        with self._stepped:
            done = self._stepped.wait_for(
                lambda: others <= self._done_secondaries or self._error is not None, timeout
            )
            missing = sorted(others - self._done_secondaries)
        if not done:
            logger.warning(
                "gradient server %r: secondaries %s did not stop within %s s of the primary; pushes they "
                "still hold will be dropped at shutdown (booked in their ledgers)",
                self.server_name,
                missing,
                timeout,
            )

    def watch(self) -> None:
        """Re-raise a reducer thread's error (original type, the thread's traceback as ``__cause__``).

        Call it periodically on every reducer process; it returns ``None`` while all is well.
        """
        err = self._error
        if err is not None:
            if err.__cause__ is None:
                err.__cause__ = ReducerTraceback(self._error_text)
            raise err

    def wait_for_version(self, version: int, timeout: float) -> bool:
        """On the primary, wait until the managed model reaches ``version`` (or the reducer fails).

        Args:
            version: The version to wait for.
            timeout: Seconds to wait at most.

        Returns:
            ``True`` if the version was reached, ``False`` on timeout or reducer failure (see :meth:`watch`).

        Raises:
            RuntimeError: This process is not the primary reducer.
        """
        if not self.is_primary:
            raise RuntimeError(f"process {self._me!r} is not the primary reducer; it holds no model version")
        with self._stepped:
            self._stepped.wait_for(lambda: self._version >= version or self._error is not None, timeout)
            return self._version >= version

    def stats(self) -> GradServerStats:
        """A snapshot of this process's counters."""
        with self._lock:
            snap = dataclasses.replace(self._stats)
        total = self._ledger.snapshot().total
        snap.received = total.accepted
        snap.duplicates = total.duplicates
        snap.dropped_stale = total.refused_stale + total.dropped_stale
        snap.applied = total.applied
        snap.dropped_overflow = self._secondary_q.dropped + self._primary_q.dropped
        snap.version = self._version if self.is_primary else self._known_head
        return snap

    def ledger(self) -> GradLedger:
        """A snapshot of this process's ledger: what became of the client pushes it handled, per client.

        A secondary books what it accepted, refused and dropped; the primary what it applied and dropped.
        Merge the ledgers of every reducer of the server (:meth:`GradLedger.merge`, or ask any client
        accessor's :meth:`~pc_server.PushPullGradServer.ledger`); after every reducer stopped (secondaries
        first) the merged ledger is balanced: ``accepted == applied + dropped``.
        """
        return self._ledger.snapshot()

    # ------------------------------------------------------------------ services
    def _push_service(self, payload: Any, level: int) -> Any:
        if level == REDUCE_SLAVE:
            return self._accept_push(payload)
        if level == REDUCE_MASTER:
            if not self.is_primary:
                raise ValueError(f"{self._me!r} is not the primary reducer of {self.server_name!r}")
            forward, age = payload
            return self._receive_forward(forward, age)
        if level == LEDGER_LEVEL:
            return self.ledger()
        raise ValueError(f"unknown push level {level!r}; expected REDUCE_MASTER (0) or REDUCE_SLAVE (1)")

    def _receive_forward(self, forward: _Forward | _Done, age: float) -> int:
        """Queue a secondary's bundle on the primary; return the model version (the secondary's head)."""
        if isinstance(forward, _Done):
            with self._stepped:
                self._done_secondaries.add(forward.member)
                self._stepped.notify_all()
            return self._version
        if not isinstance(forward, _Forward):
            raise TypeError(
                f"expected a gradient bundle from a secondary reducer, got {type(forward).__name__}"
            )
        self._primary_q.put((forward, age), age=age)
        return self._version

    def _accept_push(self, message: Any) -> tuple[bool, int]:
        if not isinstance(message, GradMessage) or not isinstance(message.grads, Packed):
            raise TypeError(
                f"expected a GradMessage from PushPullGradServer.push, got {type(message).__name__}"
            )
        if not self.is_secondary:
            raise ValueError(f"{self._me!r} is not a secondary reducer of {self.server_name!r}")
        if self._error is not None or self._secondary_q.closed:
            raise ReducerStoppedError(
                f"gradient server {self.server_name!r}: the reducer on {self._me!r} "
                f"{'failed' if self._error is not None else 'was stopped'}; no pushes accepted"
            )
        schema = (message.grads.names, message.grads.shapes)
        with self._lock:
            if self._schema is None:
                self._schema = schema
            elif schema != self._schema:
                raise ValueError(
                    f"gradient names/shapes {list(zip(*schema, strict=True))} differ from the first "
                    f"push's {list(zip(*self._schema, strict=True))}"
                )
            # A client that computed on version v proves the head is >= v; a co-located primary knows it.
            self._known_head = max(self._known_head, message.version)
            head = self._version if self.is_primary else self._known_head
            last_seq, last_accepted = self._last_seq.get(message.client, (0, False))
            if message.seq <= last_seq:
                # a retry (the reply was lost): answer as the first time, never queue it twice
                self._ledger.record("duplicates", {message.client: 1})
                return (last_accepted if message.seq == last_seq else False), head
            if self.max_staleness is not None and head - message.version > self.max_staleness:
                self._last_seq[message.client] = (message.seq, False)
                self._ledger.record("refused_stale", {message.client: 1})
                return False, head
        # one client pushes one message at a time, so nothing else can book this (client, seq) meanwhile
        self._secondary_q.put(_Queued(message.version, message.grads, time.monotonic(), message.client))
        with self._lock:
            self._last_seq[message.client] = (message.seq, True)
        self._ledger.record("accepted", {message.client: 1})
        return True, head

    # ------------------------------------------------------------------ reducer threads
    def _spawn(self, role: str, loop: Callable[[], None]) -> threading.Thread:
        thread = threading.Thread(
            target=self._run_guarded,
            args=(loop, role),
            name=f"pc-server {self.server_name} {role}",
            daemon=True,
        )
        thread.start()
        return thread

    def _run_guarded(self, loop: Callable[[], None], role: str) -> None:
        try:
            loop()
        except BaseException as exc:  # reported through watch(): the first failure of this process
            with self._stepped:
                if self._error is None:
                    self._error_text = traceback.format_exc()
                    self._error = exc
                self._stepped.notify_all()
            logger.error("gradient server %r: reducer on %r failed: %r", self.server_name, self._me, exc)
            self._secondary_q.close()
            self._primary_q.close()
            # account for what the failed thread held or would have reduced: nothing is lost silently
            lost = [self._inflight.pop(role, {})]
            if role == "secondary":
                lost += [{item.client: 1} for item in self._secondary_q.drain()]
            else:
                lost += [_forward_clients(fwd) for fwd, _age in self._primary_q.drain()]
            self._ledger.record("dropped_error", _per_client(lost))

    def _secondary_loop(self) -> None:
        while True:
            batch = self._secondary_q.get_batch(self.reduce_batch_size, self.flush_timeout)
            if batch is None:
                return
            clients: dict[int, Counter[str]] = {}
            for item in batch:
                clients.setdefault(item.version, Counter())[item.client] += 1
            self._inflight["secondary"] = _per_client(clients.values())
            oldest = min(item.enqueued for item in batch)
            groups = reduce_pushes(((it.version, unpack(it.grads, self.reduce_device)) for it in batch), None)
            head = self._version if self.is_primary else self._known_head
            kept, _dropped = drop_stale(groups, head, self.max_staleness)
            self._ledger.record("dropped_stale", _per_client(clients[v] for v in groups if v not in kept))
            if not kept:
                self._inflight.pop("secondary", None)
                continue
            forward = _Forward({v: (pack(p.sums), p.pushes, dict(clients[v])) for v, p in kept.items()})
            age = time.monotonic() - oldest
            try:
                head = self._forward(forward, age)
            except (ReducerStoppedError, ConnectionError, KeyError) as exc:
                if self._error is not None or not self._secondary_q.closed:
                    raise  # a failure (the co-located primary's, or the transport's): booked as dropped_error
                # shutting down and the primary is gone or stopped first: booked, and said out loud
                n = self._ledger.record("dropped_shutdown", _forward_clients(forward))
                self._inflight.pop("secondary", None)
                logger.warning(
                    "gradient server %r: the primary %r stopped before the secondary %r; dropping a final "
                    "bundle of %d pushes (%r). Stop the secondaries before the primary.",
                    self.server_name,
                    self.primary_reducer,
                    self._me,
                    n,
                    exc,
                )
                continue
            self._inflight.pop("secondary", None)
            with self._lock:
                self._stats.forwarded += 1
                self._known_head = max(self._known_head, int(head))

    def _forward(self, forward: _Forward, age: float) -> int:
        """Send a bundle to the primary: a direct call when co-located, else one RPC addressed by name."""
        if self.is_primary:
            return self._receive_forward(forward, age)
        return int(
            call_member(
                self.group,
                self.primary_reducer,
                deliver_forward,
                (self.group.get_group_name(), self.server_name, forward, age),
                self.server_name,
            )
        )

    def _primary_loop(self) -> None:
        while True:
            batch = self._primary_q.get_batch(self.reduce_batch_size, self.flush_timeout)
            if batch is None:
                return
            clients: dict[int, list[dict[str, int]]] = {}
            parts = []
            for fwd, _age in batch:
                part = {}
                for v, (packed, count, per_client) in fwd.partials.items():
                    part[v] = Partial(unpack(packed, self.reduce_device), count)
                    clients.setdefault(v, []).append(per_client)
                parts.append(part)
            self._inflight["primary"] = _per_client(c for cs in clients.values() for c in cs)
            groups = merge_partials(parts, None)
            kept, _dropped = drop_stale(groups, self._version, self.max_staleness)
            stale = [c for v, cs in clients.items() if v not in kept for c in cs]
            self._ledger.record("dropped_stale", _per_client(stale))
            if not kept:
                self._inflight.pop("primary", None)
                continue
            grads, _count = finalize(kept, self.reduce_method)
            self._step(grads)
            self._ledger.record("applied", _per_client(c for v in kept for c in clients[v]))
            self._inflight.pop("primary", None)
            with self._stepped:
                self._stats.steps += 1
                self._stepped.notify_all()

    def _step(self, grads: dict[str, torch.Tensor]) -> None:
        model = self.model
        if model is None:  # start() checks this; kept for the type checker
            raise RuntimeError("no managed model")
        params = dict(model.named_parameters())
        unknown = sorted(grads.keys() - params.keys())
        if unknown:
            raise ValueError(f"pushed gradients name parameters the managed model lacks: {unknown}")
        for name, param in params.items():
            param.grad = None
            if not param.requires_grad:
                continue
            grad = grads.get(name)
            if grad is None:
                raise ValueError(f"pushed gradients lack managed parameter {name!r}")
            param.grad = grad.to(param.device, param.dtype)
        self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self._version += 1
        set_pp_version(model, self._version)
        if not self._publish(model_snapshot(model), self._version, self._version - 1):
            raise RuntimeError(
                f"gradient server {self.server_name!r}: publishing version {self._version} of "
                f"{self.model_name!r} was refused; another process writes the same key"
            )

    def _publish(self, snap: Packed, version: int, prev: int | None) -> bool:
        if self._o_server_impl is not None:  # hosted here: no RPC, and the snapshot is already private
            return self._o_server_impl._store.push(self.model_name, snap, version, prev).accepted
        return self.o_server.push(self.model_name, snap, version, prev)
