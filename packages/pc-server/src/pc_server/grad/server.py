"""The gradient server: a two-level reduction tree that applies client gradients to a managed model.

::

    clients --push (1 RPC)--> secondary reducer k  [queue: B pushes, or the oldest waited flush_timeout]
                                   | per-version partial sums (sum, count), stale groups pre-filtered
                                   v  direct call when co-located, else 1 RPC addressed by member name
                              primary reducer      [queue: B forwards, same trigger]
                                   | drop groups with head - v > max_staleness; sum or count-weighted mean
                                   v
                              managed model: p.grad = g; optimizer.step(); lr_scheduler.step(); version += 1
                                   | CPU snapshot, compare-and-set
                                   v
                              ordered server  <--pull (1 RPC, state only when newer)-- clients

With full batches the primary steps once per ``reduce_batch_size ** 2`` pushes. Every member that constructs
an Impl and is a secondary must ``start()`` it (``grad_server_helper`` does), otherwise gradients routed there
wait. This module is the facade: the settings are a frozen :class:`~pc_server.GradServerConfig`, and the
two roles are separate objects (``_secondary_reducer.SecondaryReducer``, ``_primary_reducer.PrimaryReducer``),
each owning its queue, thread and counters; every push they handle is booked in the process's ledger. Each
message kind has a service of its own (``_protocol.py``): a secondary takes pushes, the primary forwards,
every reducer answers ledger requests. The checkpoint (``_checkpoint.GradCheckpoint``) reads the roles and
the ledger.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from pc_server._group import GroupLike, call_service, check_group
from pc_server._packing import Packed
from pc_server.errors import ReducerStoppedError
from pc_server.grad._checkpoint import GradCheckpoint
from pc_server.grad._primary_reducer import PrimaryReducer
from pc_server.grad._protocol import (
    REDUCE_MASTER,
    REDUCE_SLAVE,
    Done,
    Forward,
    GradMessage,
    forward_service_name,
    ledger_service_name,
    reducer_service_name,
)
from pc_server.grad._reducer_base import ReducerHealth
from pc_server.grad._secondary_reducer import SecondaryReducer
from pc_server.grad.client import PushPullGradServer
from pc_server.grad.config import GradServerConfig
from pc_server.grad.ledger import GradLedger, LedgerBook
from pc_server.grad.stats import GradServerStats
from pc_server.ordered_server import OrderedServerBase, OrderedServerSimple, OrderedServerSimpleImpl

__all__ = ["STOP_TIMEOUT_S", "PushPullGradServerImpl"]

STOP_TIMEOUT_S = 60.0
"""Default seconds :meth:`PushPullGradServerImpl.stop` waits for each reducer thread."""


class PushPullGradServerImpl:
    """A parameter server that synchronises a model by pushing gradients and pulling back parameters.

    Construct it on the primary reducer and on every secondary reducer (all members of ``group``), then call
    :meth:`manage_model` on the primary and :meth:`start` everywhere. The primary pairs a
    :class:`~pc_server.PushPullGradServer` accessor under ``server_name``. No strict order is guaranteed:
    pushes return once queued and are applied in a later batch.

    Safe to share between threads: the lifecycle calls (:meth:`manage_model`, :meth:`load_state_dict`,
    :meth:`start`, :meth:`stop`) exclude each other, and the rest read under the reducers' locks
    (:meth:`state_dict` is of one step while the server runs).

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
        flush_timeout: Seconds after which a partial batch is reduced anyway (``None``: never).
        max_staleness: Drop gradients computed on a version more than this many steps behind the newest
            (``None``: unbounded).

    Raises:
        TypeError: Wrong argument types.
        ValueError: Bad values (unknown reducers, a non-positive batch size, ``max_queue_size`` smaller than
            the batch size, this process being neither primary nor secondary, ...).
    """

    REDUCE_MASTER = REDUCE_MASTER
    """Service level of a secondary-to-primary forward (compatibility name; no message carries it)."""
    REDUCE_SLAVE = REDUCE_SLAVE
    """Service level of a client-to-secondary push (compatibility name; the push service accepts it)."""

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
        checked = check_group(group)
        config = GradServerConfig.build(
            group,
            server_name,
            model_name,
            primary_reducer,
            secondary_reducers,
            reduce_method,
            reduce_device,
            reduce_batch_size,
            max_queue_size,
            flush_timeout,
            max_staleness,
        )
        self._set_up(checked, config, o_server)

    @classmethod
    def from_config(
        cls, group: GroupLike, config: GradServerConfig, o_server: OrderedServerBase | None = None
    ) -> PushPullGradServerImpl:
        """The server of settings made by :meth:`GradServerConfig.build` (``__init__`` builds them itself).

        Args:
            group: The RpcGroup the configuration was built against.
            config: The settings.
            o_server: A custom ordered server accessor (see the class).

        Raises:
            TypeError: ``config`` is not a GradServerConfig, or ``group``/``o_server`` is bad.
            ValueError: ``config`` was built for another member than this process's.
        """
        checked = check_group(group)
        if not isinstance(config, GradServerConfig):
            raise TypeError(f"config must be a GradServerConfig, got {type(config).__name__}")
        if config.me != checked.get_cur_name():
            raise ValueError(
                f"config was built for member {config.me!r}, not for this process "
                f"({checked.get_cur_name()!r})"
            )
        impl = cls.__new__(cls)
        impl._set_up(checked, config, o_server)
        return impl

    def _set_up(self, group: GroupLike, cfg: GradServerConfig, o_server: OrderedServerBase | None) -> None:
        """Build the roles of this process and register their services (shared by both constructors)."""
        self.group = group
        self.config = cfg
        server_name = cfg.server_name
        o_server_impl: OrderedServerSimpleImpl | None = None
        if o_server is None:
            o_name = server_name + "_o_server"
            if cfg.is_primary:
                o_server_impl = OrderedServerSimpleImpl(o_name, group)
            o_server = OrderedServerSimple(o_name, group)
        if not isinstance(o_server, OrderedServerBase):
            raise TypeError(f"o_server must be an OrderedServerBase accessor, got {type(o_server).__name__}")
        self.o_server = o_server

        self._lock = threading.Lock()  # guards the lifecycle flags
        self._started = False
        self._stopped = False
        self._ledger = LedgerBook()
        self._health = ReducerHealth()
        self._primary = (
            PrimaryReducer(cfg, self._ledger, self._health, o_server, o_server_impl)
            if cfg.is_primary
            else None
        )
        self._secondary = None
        if cfg.is_secondary:
            primary = self._primary
            self._secondary = SecondaryReducer(
                cfg,
                self._ledger,
                self._health,
                primary.receive if primary is not None else self._forward_remote,  # co-located: direct call
                (lambda: primary.version) if primary is not None else None,
            )
        self._checkpoint = GradCheckpoint(cfg, self._ledger, self._primary, self._secondary)

        # one service per message kind: pushes go to secondaries, forwards to the primary, every reducer
        # answers ledger requests
        if self._secondary is not None:
            group.register(reducer_service_name(server_name, cfg.me), self._push_service)
        if self._primary is not None:
            group.register(forward_service_name(server_name, cfg.me), self._primary.receive)
        group.register(ledger_service_name(server_name, cfg.me), self.ledger)
        if self._primary is not None:
            group.pair(
                server_name,
                PushPullGradServer(
                    server_name,
                    group,
                    cfg.model_name,
                    list(cfg.secondary_reducers),
                    o_server,
                    cfg.primary_reducer,
                ),
            )

    # ------------------------------------------------------------------ settings (read-only views of config)
    @property
    def server_name(self) -> str:
        """The server's name."""
        return self.config.server_name

    @property
    def model_name(self) -> str:
        """The model's key in the ordered server."""
        return self.config.model_name

    @property
    def primary_reducer(self) -> str:
        """The primary reducer's member name."""
        return self.config.primary_reducer

    @property
    def secondary_reducers(self) -> list[str]:
        """The secondary reducers' member names."""
        return list(self.config.secondary_reducers)

    @property
    def is_primary(self) -> bool:
        """Whether this process is the primary reducer."""
        return self.config.is_primary

    @property
    def is_secondary(self) -> bool:
        """Whether this process is a secondary reducer."""
        return self.config.is_secondary

    @property
    def model(self) -> nn.Module | None:
        """The managed model (primary; ``None`` elsewhere or before :meth:`manage_model`)."""
        return self._primary.model if self._primary is not None else None

    @property
    def optimizer(self) -> Any:
        """The managed model's optimizer (primary)."""
        return self._primary.optimizer if self._primary is not None else None

    @property
    def lr_scheduler(self) -> Any:
        """The managed model's lr scheduler (primary), or ``None``."""
        return self._primary.lr_scheduler if self._primary is not None else None

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
        if self._primary is None:
            raise RuntimeError(
                f"process {self.config.me!r} is not the primary reducer ({self.primary_reducer!r}) "
                "and cannot manage the model"
            )
        with self._lock:  # start() and load_state_dict() wait: never a model swapped under them
            if self._started or self._stopped:
                raise RuntimeError("manage_model() must be called before start()")
            self._primary.manage(model, optimizer, lr_scheduler)

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
            if self._primary is not None and self._primary.model is None:
                raise RuntimeError("call manage_model() on the primary reducer before start()")
            self._started = True
        for role in (self._secondary, self._primary):
            if role is not None:
                role.start()

    def stop(self, timeout: float | None = STOP_TIMEOUT_S, *, secondaries_timeout: float = 10.0) -> None:
        """Stop accepting pushes, reduce what is queued, and join the reducer threads (idempotent).

        The secondary drains first (forwarding its partial sums) and then tells the primary it is done; the
        primary waits up to ``secondaries_timeout`` seconds for every other secondary to be done before it
        drains and applies what it holds. So every reducer may call ``stop()`` at the same time; a secondary
        that stops later than that finds the primary gone and books its last pushes as ``dropped_shutdown``
        in the :meth:`ledger` (with a warning). A reducer that was never started books what it queued as
        ``dropped_shutdown`` too.

        Args:
            timeout: Seconds to wait for each thread. ``None`` waits until it drained its closed queue, which
                ends: draining waits only on forward RPCs (bounded by the RPC timeout) and optimizer steps.
            secondaries_timeout: On the primary, seconds to wait for the other secondaries to finish
                (woken by each one's final message); ``0`` does not wait.

        Raises:
            TimeoutError: A reducer thread did not finish within ``timeout`` (named in the message).
        """
        with self._lock:
            self._stopped = True
        if self._secondary is not None:
            self._secondary.stop(timeout)
            if self._primary is None:
                self._secondary.say_done()
        if self._primary is not None:
            self._primary.wait_for_secondaries(secondaries_timeout)
            self._primary.stop(timeout)

    def watch(self) -> None:
        """Re-raise a reducer thread's error (original type, the thread's traceback as ``__cause__``).

        Call it periodically on every reducer process; it returns ``None`` while all is well.
        """
        self._health.raise_if_failed()

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
        if self._primary is None:
            raise RuntimeError(
                f"process {self.config.me!r} is not the primary reducer; it holds no model version"
            )
        return self._primary.wait_for_version(version, timeout)

    def stats(self) -> GradServerStats:
        """A snapshot of this process's counters (its ledger totals and the reducers' own counters)."""
        sec, prim = self._secondary, self._primary
        return GradServerStats(
            pushes=self._ledger.snapshot().total,
            forwarded=sec.forwarded if sec is not None else 0,
            steps=prim.steps if prim is not None else 0,
            version=prim.version if prim is not None else (sec.head if sec is not None else 0),
        )

    def ledger(self) -> GradLedger:
        """A snapshot of this process's ledger: what became of the client pushes it handled, per client.

        A secondary books what it accepted, refused and dropped; the primary what it applied and dropped.
        Merge the ledgers of every reducer of the server (:meth:`GradLedger.merge`, or ask any client
        accessor's :meth:`~pc_server.PushPullGradServer.ledger`); after every reducer stopped the merged
        ledger is balanced: ``accepted == applied + dropped``.
        """
        return self._ledger.snapshot()

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """A checkpoint of this reducer process for ``torch.save`` (recipe: docs/server.md, "Checkpoint").

        The primary's part: model, optimizer and scheduler state, version and steps, of one step (safe while
        running); a secondary's: its ``(client, seq)`` table; every process's: its :meth:`ledger` and the
        pushes it accepted and has not passed on (re-queued by the restored server; docs/server.md).

        Raises:
            RuntimeError: On the primary, before :meth:`manage_model`.
        """
        return self._checkpoint.state()

    def load_state_dict(self, state: Any) -> None:
        """Restore this process's :meth:`state_dict` after :meth:`manage_model` and before :meth:`start`.

        The whole checkpoint is checked first (the envelope, the ledger and the pushes it holds, the model's
        keys and shapes, the optimizer's and scheduler's types and keys); one that does not fit whole is
        refused and nothing changes. Loading replaces the state, so loading the same checkpoint twice equals
        loading it once. The primary loads into the managed objects and publishes the restored version for
        clients to pull.

        Args:
            state: The checkpoint this reducer (same server name, same roles) wrote.

        Raises:
            RuntimeError: The server already started or stopped, (primary) no model is managed yet, or this
                process booked pushes since it was built or last loaded (a load would erase them).
            TypeError: ``state`` is not a dict, or its optimizer or scheduler is of another type than the
                managed one (named), or holds state a managed object cannot load.
            ValueError: Another server's or role's checkpoint, or entries that do not fit (named).
        """
        with self._lock:  # start() waits: a running server is never loaded into
            if self._started or self._stopped:
                raise RuntimeError(
                    f"gradient server {self.server_name!r}: load_state_dict() must be called before start()"
                )
            self._checkpoint.load(state)

    # ------------------------------------------------------------------ services
    def _push_service(self, message: Any, level: int = REDUCE_SLAVE) -> tuple[bool, int]:
        """The push service of a secondary: book and queue one client push; return ``(accepted, head)``.

        Args:
            message: The :class:`~pc_server.grad._protocol.GradMessage` of one push.
            level: Only ``REDUCE_SLAVE`` (the default), for the compatible call ``(message, REDUCE_SLAVE)``.

        Raises:
            TypeError: ``message`` is not a push from ``PushPullGradServer.push``.
            ValueError: Another ``level``, or this process is not a secondary reducer of the server.
        """
        if level != REDUCE_SLAVE:
            raise ValueError(
                f"unknown push level {level!r}: the push service takes client pushes only (REDUCE_SLAVE = "
                f"{REDUCE_SLAVE}); forwards to the primary (REDUCE_MASTER) never come here"
            )
        if not isinstance(message, GradMessage) or not isinstance(message.grads, Packed):
            raise TypeError(
                f"expected a GradMessage from PushPullGradServer.push, got {type(message).__name__}"
            )
        if self._secondary is None:
            raise ValueError(f"{self.config.me!r} is not a secondary reducer of {self.server_name!r}")
        return self._secondary.accept(message)

    def _forward_remote(self, forward: Forward | Done, age: float) -> int:
        """One RPC to the primary's service, addressed to its member: no directory look-up in the store."""
        cfg = self.config
        service = forward_service_name(cfg.server_name, cfg.primary_reducer)
        args = (forward, age)
        return int(call_service(self.group, service, args, cfg.server_name, owner=cfg.primary_reducer))
