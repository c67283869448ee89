"""ElasticDataParallel: synchronous data parallelism whose members may die or join between and during steps.

::

    member (each process)                                 the store (served by torchrun's agent / run_world)
    ---------------------                                 ---------------------------------------------------
    heartbeat thread: hb/<me> += 1 every period   ----->  hb/*, reg/*, left/*
    train_step(compute):
      1. ready/<a>/<me> = committed steps         ----->  q/<a> = quorum (compare_set, first proposal wins)
         wait for every live member, read q/<a>   <-----
      2. group for q/<a> (gloo or NCCL, keys pg/<group>); the lowest up-to-date member's state -> q.sync
      3. compute(ctx): forward/backward on this member's share of the step's batch
      4. all-reduce [w * grads, w * buffers, w];  done/<a>/<me>  ----->  decide/<a> = commit | abort
      5. commit: the lowest member decides q/<a+1> = the same members if nothing changed  ----->  q/<a+1>
                 grads = sum(w * grads) / sum(w), optimizer.step(), buffers = their average, step += 1
         abort:  nothing applied, buffers restored; the same step is re-run as attempt a + 1
    housekeeping thread (a commit's last member): committed, deletes attempt a - RETAIN's keys  ----->

Everything the members must agree on (who is in a step, whether the step counts) is decided once in the store
by ``compare_set`` and read by all, so they cannot disagree; a member that cannot reach the store raises
instead of going on alone (no split brain).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

import pc_distributed.parallel.elastic._quorum as _quorum
from pc_distributed._checks import int_at_least, positive_seconds
from pc_distributed.parallel.elastic._connect import connect
from pc_distributed.parallel.elastic._engine import engine_for
from pc_distributed.parallel.elastic._housekeeper import Housekeeper
from pc_distributed.parallel.elastic._membership import Membership
from pc_distributed.parallel.elastic._quorum import (
    Quorum,
    QuorumRules,
    StaleAttempt,
    decide,
    form_quorum,
    propose_next,
    start_attempt,
)
from pc_distributed.parallel.elastic._state import share_state

__all__ = ["ElasticDataParallel", "QuorumEntry", "StepContext"]

logger = logging.getLogger(__name__)


class QuorumEntry(NamedTuple):
    """One committed step of the quorum log: the step's number and the members that trained it (sorted)."""

    step: int
    members: tuple[str, ...]


@dataclass(frozen=True)
class StepContext:
    """What ``compute`` needs to train its share of a step.

    Attributes:
        step: The step's number (committed steps before it); a re-run of an aborted step has the same.
        members: The step's members, sorted by name.
        member: This member's name.
        rank: This member's index in ``members``.
    """

    step: int
    members: tuple[str, ...]
    member: str
    rank: int

    @property
    def size(self) -> int:
        """Number of members in the step."""
        return len(self.members)


class ElasticDataParallel:
    """Data-parallel training that goes on when members die or join: each step is all or nothing.

    Every member wraps its replica of ``module`` and its ``optimizer`` and calls :meth:`train_step` with a
    function that runs forward and backward on its share of the step's data (see
    :class:`~pc_distributed.ElasticSampler`). Each step's gradients are averaged over that step's quorum (the
    live members at the step boundary, plus members joining there), weighted by what ``compute`` returns
    (the number of samples it trained; ``None`` counts as 1), and the optimizer step is applied by every
    member of the quorum or by none. A step whose reduction fails (a member died or hung in it) is re-run
    with the next quorum, on the same data. A new member (same script, new name) enters at a step boundary
    and receives the model, the optimizer state and the step count from a live member.

    The module's buffers stay equal on every member: floating buffers (BatchNorm's running statistics) are
    averaged over the step's members in the same reduction as the gradients, with the same weights, when
    the step commits; every buffer is restored to its value before ``compute`` (after any state received)
    when it aborts, so that a re-run does not count the aborted forward twice. For BatchNorm's running mean
    the average is the running mean of the step's whole batch; its running variance is the weighted mean of
    the members' (without the spread between the members' means), as each member's batch statistics are
    its own.

    Args:
        module: This member's replica (floating-point parameters of one dtype and device, buffers on it too;
            CPU or CUDA).
        optimizer: The optimizer over ``module``'s parameters.
        name: This member's name, unique in the job for the life of the job (a restarted process needs a
            new one, e.g. with ``TORCHELASTIC_RESTART_COUNT`` in it).
        store: A ``torch.distributed.Store`` served by a process that outlives the workers, or None: the
            store of torchrun's agent or ``run_world``'s launcher (``MASTER_ADDR``/``MASTER_PORT`` with
            ``TORCHELASTIC_USE_AGENT_STORE=True``). A store served by a rank is refused.
        job: Names the job's keys in the store (several elastic jobs may share one store).
        min_members: Fewest members a step may run with.
        initial_members: Fewest members the job's first step may run with (None: ``min_members``): the
            members that start the job wait for each other, so that none trains alone while the others
            are still starting.
        max_members: Most members a step may run with (None: no limit); extra joiners wait.
        heartbeat_period: Seconds between heartbeats.
        member_timeout: Seconds without a heartbeat after which a member is dead for the others.
        quorum_timeout: Seconds a step boundary waits for live members that are not there yet; below
            ``min_members``, the bound after which it raises ``TimeoutError``.
        collective_timeout: Seconds of the group's rendezvous and of each collective (a member that hangs
            inside a reduction costs the others this long before the step is aborted).
        store_timeout: Seconds of each store request (a member cut off from the store raises after this).
        dist_backend: What carries each quorum's collectives: ``"gloo"`` (None: the default; any device, a
            CUDA module's sums and state travel through host memory) or ``"nccl"`` (a CUDA module, one GPU per
            member; the sums stay on the device; each collective runs on a helper thread bounded by
            ``collective_timeout``, after which the group is aborted).

    Attributes:
        aborted_attempts: Attempts of this member that were aborted (and re-run with the next quorum).

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: Bad values, a name already in use, a store that would die with a rank, or
            ``dist_backend='nccl'`` for a module not on a CUDA device.
        TimeoutError: If the store cannot be reached within ``store_timeout``.
        RuntimeError: If this torch build lacks the engine (no gloo; no NCCL groups that can be aborted).

    Examples:
        >>> sgd = torch.optim.SGD(model.parameters(), lr=0.1)  # doctest: +SKIP
        >>> edp = ElasticDataParallel(model, sgd, name="w0")  # doctest: +SKIP
        >>> while edp.step < 100:  # doctest: +SKIP
        ...     edp.train_step(lambda ctx: train_on(sampler.indices(ctx.step, ctx.members, ctx.member)))
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        name: str,
        store: Any = None,
        job: str = "default",
        min_members: int = 1,
        initial_members: int | None = None,
        max_members: int | None = None,
        heartbeat_period: float = 0.5,
        member_timeout: float = 5.0,
        quorum_timeout: float = 60.0,
        collective_timeout: float = 30.0,
        store_timeout: float = 30.0,
        dist_backend: str | None = None,
    ) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        for label, value in (("name", name), ("job", job)):
            if not isinstance(value, str) or not value or "/" in value:
                raise ValueError(f"{label} must be a non-empty string without '/', got {value!r}")
        self.min_members = int_at_least("min_members", min_members, 1)
        self.initial_members = (
            self.min_members
            if initial_members is None
            else int_at_least("initial_members", initial_members, self.min_members)
        )
        self.max_members = (
            2**31 if max_members is None else int_at_least("max_members", max_members, self.min_members)
        )
        self.heartbeat_period = positive_seconds("heartbeat_period", heartbeat_period)
        self.member_timeout = positive_seconds("member_timeout", member_timeout)
        if self.member_timeout <= self.heartbeat_period:
            raise ValueError(
                f"member_timeout must exceed heartbeat_period, got {member_timeout!r} <= {heartbeat_period!r}"
            )
        self.quorum_timeout = positive_seconds("quorum_timeout", quorum_timeout)
        self.collective_timeout = positive_seconds("collective_timeout", collective_timeout)
        store_timeout = positive_seconds("store_timeout", store_timeout)
        self._params = [p for p in module.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError("module has no parameters that require grad")
        kinds = {(p.dtype, p.device) for p in self._params}
        if len(kinds) != 1 or not self._params[0].is_floating_point():
            raise ValueError(
                f"module's parameters must share one floating dtype and device, got {sorted(map(str, kinds))}"
            )
        self._engine = engine_for(dist_backend, self._params[0].device, self.collective_timeout)
        self._buffers = list(module.buffers())
        self._float_buffers = [b for b in self._buffers if b.is_floating_point()]
        if any(b.device != self._params[0].device for b in self._buffers):
            raise ValueError("module's buffers must be on its parameters' device")
        owned = {id(p) for p in module.parameters()}
        if any(id(p) not in owned for g in optimizer.param_groups for p in g["params"]):
            raise ValueError("optimizer holds parameters that are not module's")
        self.module = module
        self.optimizer = optimizer
        self.name = name
        self.job = job
        self._stores = connect(store, job, store_timeout)
        self._membership = Membership(self._stores.beat, name, self.heartbeat_period, self.member_timeout)
        try:
            self._membership.claim()
            self._membership.start()
            self._attempt = start_attempt(self._stores)
        except BaseException:
            self._membership.stop()
            self._stores.close()
            raise
        self._housekeeper = Housekeeper(self._stores.chores, self._membership.registered, name)
        self._version = -1  # committed steps this replica holds; -1 until its first synchronisation
        self._enlisted = False
        self._group: Any = None
        self._group_id = -1
        self._closed = False
        self._log: list[QuorumEntry] = []
        self._last: tuple[Quorum, bool] | None = None  # this member's last attempt and its decision
        self._rules = QuorumRules(
            self.min_members, self.initial_members, self.max_members, self.quorum_timeout, self.member_timeout
        )
        self._buffers_before: list[torch.Tensor] | None = None  # the buffers before this attempt's compute
        self.aborted_attempts = 0

    @property
    def step(self) -> int:
        """Committed steps so far (0 before the first; a new member takes it from the quorum)."""
        return max(self._version, 0)

    @property
    def quorum_log(self) -> tuple[QuorumEntry, ...]:
        """The committed steps this member took part in, with each step's members (for replays and audits)."""
        return tuple(self._log)

    def train_step(self, compute: Callable[[StepContext], float | int | None]) -> QuorumEntry:
        """Run one step to its commit: re-run with the next quorum until a quorum commits it.

        Args:
            compute: ``compute(ctx)`` runs forward and backward on this member's share of step ``ctx.step``
                for the members ``ctx.members`` and returns its weight in the average (the number of
                samples it trained; None: 1). It may run more than once for one step (after an abort),
                each time after the gradients were cleared.

        Returns:
            The committed step's number and members.

        Raises:
            TimeoutError: Fewer than ``min_members`` at a step boundary after ``quorum_timeout`` (naming who
                is missing), or the store does not answer within ``store_timeout``.
            ConnectionError: If the store is lost.
            RuntimeError: If the member was closed.
            Exception: What ``compute`` raises (the member stops taking part; the others go on without it).
        """
        if self._closed:
            raise RuntimeError(f"elastic member {self.name!r} is closed")
        while True:
            entry = self._attempt_step(compute)
            if entry is not None:
                return entry

    def _attempt_step(self, compute: Callable[[StepContext], float | int | None]) -> QuorumEntry | None:
        a = self._attempt
        if not self._enlisted:
            self._stores.store.set(f"ready/{a}/{self.name}", str(self._version))
            self._membership.enlist()
            self._enlisted = True
        try:
            quorum = form_quorum(self._stores, self._membership, a, self._version, self._rules, self._last)
        except StaleAttempt:  # stopped or cut off past the store's window: enter where the others are
            self._attempt = start_attempt(self._stores)
            self._enlisted = False
            self._drop_group()
            return None
        if self.name not in quorum.members:  # left out (late, silent, or beyond max_members)
            self._attempt = max(a, start_attempt(self._stores) - 1) + 1
            # Left out of a quorum that had room: the others may count it dead; enlisting again at the next
            # boundary makes them count it alive from then on (not when they next read its heartbeat).
            self._enlisted = len(quorum.members) >= self.max_members
            self._drop_group()
            return None
        self._attempt = a + 1
        averaged = self._reduce(quorum, compute)
        committed = decide(
            self._stores,
            self._membership,
            quorum,
            averaged is not None,
            self.collective_timeout,
            self.member_timeout,
        )
        self._last = (quorum, committed)
        if not committed or averaged is None:
            self._restore_buffers()
            self.aborted_attempts += 1
            self._drop_group()
            self._clear_grads()
            logger.info("elastic member %r: attempt %d of step %d aborted", self.name, a, quorum.step)
            return None
        if self.name == quorum.members[0]:  # before the optimizer step: the others look for it after theirs
            propose_next(self._stores, self._membership, quorum)
        self.optimizer.step()  # _reduce set every parameter's .grad to the quorum's average
        self._clear_grads()
        with torch.no_grad():
            for b, mean in zip(self._float_buffers, averaged, strict=True):
                b.copy_(mean)
        self._version = quorum.step + 1
        if self.name == quorum.members[-1]:  # the step's housekeeper (not the proposer, where there are two)
            self._housekeeper.record(self._version, a - _quorum.RETAIN)
        entry = QuorumEntry(quorum.step, quorum.members)
        self._log.append(entry)
        return entry

    def _reduce(
        self, quorum: Quorum, compute: Callable[[StepContext], float | int | None]
    ) -> list[torch.Tensor] | None:
        """Sync the state if needed, run ``compute``, average the gradients and the floating buffers.

        Sets every parameter's ``.grad`` to the average and returns the buffers' averages (applied only if
        the step commits); None if a collective failed.
        """
        rank = quorum.members.index(self.name)
        self._buffers_before = None
        try:
            group = self._group_for(quorum, rank)
            if quorum.sync:
                self._share(group, quorum, rank)
        except RuntimeError as exc:  # a member did not arrive or died in the transfer
            logger.info("elastic member %r: quorum %d's group failed: %r", self.name, quorum.attempt, exc)
            self._drop_group()
            return None
        self._clear_grads()
        # After the state transfer (an abort must not undo what this member received), before the forward.
        self._buffers_before = [b.detach().clone() for b in self._buffers]
        try:
            weight = compute(StepContext(quorum.step, quorum.members, self.name, rank))
            w = 1.0 if weight is None else float(weight)
            if not w > 0:
                raise ValueError(
                    f"compute must return a positive weight (samples trained) or None, got {weight!r}"
                )
        except BaseException:
            # Leave at once, and let the group go (the traceback keeps this frame: clear the local too) so
            # its connections close and the others' reduction fails now rather than at its timeout.
            group = None
            self.close()
            raise
        p0 = self._params[0]
        parts = [
            torch.zeros_like(p).reshape(-1) if p.grad is None else p.grad.reshape(-1) for p in self._params
        ]
        parts.extend(b.detach().reshape(-1).to(p0.dtype) for b in self._float_buffers)
        parts.append(torch.ones(1, dtype=p0.dtype, device=p0.device))
        flat = torch.cat(parts)
        if w != 1.0:
            flat.mul_(w)  # the gradients and the weight itself: [w * g, w]
        try:
            self._engine.all_reduce_sum(group, flat)
        except RuntimeError as exc:
            logger.info(
                "elastic member %r: reduction of attempt %d failed: %r", self.name, quorum.attempt, exc
            )
            self._drop_group()
            return None
        mean = flat[:-1].div_(flat[-1])
        offset = 0
        for p in self._params:  # views of this step's own buffer: no copy
            n = p.numel()
            p.grad = mean[offset : offset + n].view_as(p)
            offset += n
        averaged = []
        for b in self._float_buffers:
            n = b.numel()
            averaged.append(mean[offset : offset + n].view_as(b))
            offset += n
        return averaged

    def _restore_buffers(self) -> None:
        """After an abort: undo what this attempt's forward did to the buffers (if ``compute`` ran)."""
        if self._buffers_before is not None:
            with torch.no_grad():
                for b, old in zip(self._buffers, self._buffers_before, strict=True):
                    b.copy_(old)
            self._buffers_before = None

    def _share(self, group: Any, quorum: Quorum, rank: int) -> None:
        root = quorum.members.index(quorum.source)
        state = None
        if self.name == quorum.source:
            state = {
                "model": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "step": quorum.step,
            }
        received = share_state(
            lambda t, r: self._engine.broadcast(group, t, r), root, state, self._params[0].device
        )
        if self.name in quorum.sync:
            self.module.load_state_dict(received["model"])
            self.optimizer.load_state_dict(received["optimizer"])
        self._version = int(received["step"])

    def _group_for(self, quorum: Quorum, rank: int) -> Any:
        if self._group is None or self._group_id != quorum.group:
            self._drop_group()
            self._group = self._engine.group(
                self._stores.group_store(),
                f"{self._stores.prefix}/pg/{quorum.group}",
                rank,
                len(quorum.members),
            )
            self._group_id = quorum.group
        return self._group

    def _drop_group(self) -> None:
        # A group is never waited on again once dropped: no barrier, no graceful destroy (gloo's is let go,
        # NCCL's aborted, which also ends a collective still blocked in it).
        group, self._group, self._group_id = self._group, None, -1
        if group is not None:
            self._engine.drop(group)

    def _clear_grads(self) -> None:
        for p in self._params:
            p.grad = None

    def close(self) -> None:
        """Leave the job: stop the heartbeat, tell the others at once, close the connections (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._drop_group()
        self._membership.leave(self._stores.store)
        self._housekeeper.close(self._stores.timeout)
        self._stores.close()

    def __enter__(self) -> ElasticDataParallel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ElasticDataParallel(name={self.name!r}, job={self.job!r}, step={self.step})"
