"""DASO: node-local data parallelism plus delayed, staleness-weighted global parameter averaging.

One step, seen from one rank (``b`` is the batch index within the epoch)::

    local optimizer step (gradients were averaged inside the node by DDP, unless this batch skips it)
      │
      ├─ exchanges due at b: the sender waits, merges  p = (2S·p_local + Σ_nodes p_sent) / (2S + P),
      │                      then broadcasts its parameters to the other ranks of its node
      ├─ last batch of the epoch: finish every exchange, then one blocking global average (S = 0)
      └─ b % global_skip == 0: local rank ``send_mod`` of every node starts an async all_reduce of its
                               (downcast) parameters on its column group; merged S = batches_to_wait later

``send_mod`` rotates over the local ranks so each column group carries every G-th exchange. What travels is
``downcast(p - p_ref)``, where ``p_ref`` are the parameters of the last blocking average (equal on every
rank); the sum is restored exactly in float32 as ``Σ delta + P·p_ref``, so bf16 only rounds the drift, not the
weights.

Which collectives a rank issues, and what each carries, follows from its settings and its schedule. They are
compared across ranks, so that a difference is a ``ValueError`` on every rank rather than a gloo abort, a hang
or a merge of unlike exchanges: the settings once at construction, and the schedule of each epoch (its
position, ``last_batch``, the three skips and the averaged tensors' shapes) at its first :meth:`DASO.step`,
before its first exchange: one all_gather of a few integers per epoch.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pc_distributed._checks import bool_flag, int_at_least, optional_timeout
from pc_distributed._one_thread import OneThreadAtATime
from pc_distributed.parallel._comm import (
    CommLike,
    check_agreement,
    group_size,
    resolve_group,
    to_timedelta,
)
from pc_distributed.parallel.daso._exchange import (
    Exchange,
    complete_exchange,
    flatten,
    staleness_merge,
)
from pc_distributed.parallel.daso._schedule import PlateauDetector, SkipState, next_skips, phase_of
from pc_distributed.parallel.daso._topology import DasoTopology, build_topology, default_local_size

__all__ = ["DASO", "staleness_merge"]

logger = logging.getLogger(__name__)

_DOWNCAST_TYPES = (torch.bfloat16, torch.half, torch.float)


class DASO:
    """Distributed Asynchronous and Selective Optimization over torch.distributed.

    Use it with :class:`~pc_distributed.DataParallelMultiGPU`, which runs ``DistributedDataParallel`` inside
    each node. Training has three phases: warm-up (a blocking global average after every batch), cycling (a
    global exchange every ``global_skip`` batches, merged ``batches_to_wait`` batches later, the skips
    shrinking whenever the loss plateaus) and cool-down (blocking again). The last batch of every epoch ends
    with a blocking average, so all ranks hold identical parameters (and floating-point buffers) after each
    epoch.

    Per epoch: set :attr:`last_batch` to the index of the epoch's final batch (``len(loader) - 1``), call
    :meth:`step` after each backward, and :meth:`epoch_loss_logic` with the epoch's loss at its end.

    Args:
        local_optimizer: The torch optimizer of the local model.
        total_epochs: All epochs of training (to place the cool-down).
        comm: ``None``, a ``ProcessGroup`` or ``CollectiveGroup`` spanning the whole world.
        warmup_epochs: Epochs of blocking averaging at the start.
        cooldown_epochs: Epochs of blocking averaging at the end.
        scheduler: Optional learning-rate scheduler (any object with ``step()``). When given,
            ``scheduler.step()`` is called **instead of** ``local_optimizer.step()`` (for schedulers that wrap
            the optimizer); step an ordinary scheduler yourself.
        stability_level: The relative loss improvement below which an epoch counts as "not improving".
        max_global_skips: The largest number of batches between global exchanges, also used for the
            first cycling epoch after warm-up.
        sending_chunk_size: The largest number of elements per all_reduce of the global exchange.
        downcast_type: The dtype of the exchanged data: ``torch.bfloat16``, ``torch.half`` or ``torch.float``.
        use_mpi_groups: Accepted for compatibility; it has no effect (torch.distributed groups are used).
        skip_reduction_factor: Divisor of the skips on a plateau.
        local_skip_factor: After a reset, local skip and wait are ``max_global_skips // local_skip_factor``.
        verbose: Log the schedule at INFO level on global rank 0.
        local_size: Processes per node (keyword only). Default: ``LOCAL_WORLD_SIZE``, else the
            number of CUDA devices, else the whole world (one node). On one machine, ``local_size=2`` with 4
            processes simulates 2 nodes x 2.
        timeout: Seconds to wait for one exchange (keyword only), or ``None`` for the process group's timeout.

    Raises:
        TypeError: If an argument has the wrong type.
        ValueError: If a value is out of range, ``comm`` does not span the world, or ``local_size`` does not
            divide the world size.
        RuntimeError: If torch.distributed is not initialised.
    """

    def __init__(
        self,
        local_optimizer: torch.optim.Optimizer,
        total_epochs: int,
        comm: CommLike = None,
        warmup_epochs: int = 4,
        cooldown_epochs: int = 4,
        scheduler: Any = None,
        stability_level: float = 0.05,
        max_global_skips: int = 8,
        sending_chunk_size: int = 10_000_000,
        downcast_type: torch.dtype = torch.bfloat16,
        use_mpi_groups: bool = True,
        skip_reduction_factor: int = 2,
        local_skip_factor: int = 4,
        verbose: bool = False,
        *,
        local_size: int | None = None,
        timeout: float | None = None,
    ) -> None:
        if not isinstance(local_optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"local_optimizer must be a torch.optim.Optimizer, got {type(local_optimizer).__name__}"
            )
        int_at_least("total_epochs", total_epochs, 1)
        int_at_least("warmup_epochs", warmup_epochs, 0)
        int_at_least("cooldown_epochs", cooldown_epochs, 0)
        int_at_least("max_global_skips", max_global_skips, 0)
        int_at_least("sending_chunk_size", sending_chunk_size, 1)
        int_at_least("skip_reduction_factor", skip_reduction_factor, 1)
        int_at_least("local_skip_factor", local_skip_factor, 1)
        if scheduler is not None and not callable(getattr(scheduler, "step", None)):
            raise TypeError(f"scheduler must have a step() method, got {type(scheduler).__name__}")
        if not isinstance(stability_level, (int, float)) or isinstance(stability_level, bool):
            raise TypeError(f"stability_level must be a float, got {type(stability_level).__name__}")
        if not 0.0 <= stability_level < 1.0:
            raise ValueError(f"stability_level must be in [0, 1), got {stability_level}")
        if not isinstance(downcast_type, torch.dtype):
            raise TypeError(f"downcast_type must be a torch.dtype, got {type(downcast_type).__name__}")
        if downcast_type not in _DOWNCAST_TYPES:
            raise ValueError(f"downcast_type must be one of {list(_DOWNCAST_TYPES)}, got {downcast_type}")
        bool_flag("use_mpi_groups", use_mpi_groups)
        bool_flag("verbose", verbose)
        timeout = optional_timeout("timeout", timeout)  # None (or -1): the group's timeout
        group = resolve_group(comm)
        if group_size(group) != dist.get_world_size():
            raise ValueError(
                f"DASO needs a comm spanning the whole world ({dist.get_world_size()} ranks), got a group of "
                f"{group_size(group)}"
            )
        size = default_local_size() if local_size is None else local_size
        int_at_least("local_size", size, 1)

        self.local_optimizer = local_optimizer
        self.total_epochs = total_epochs
        self.comm = comm
        self.warmup_epochs = warmup_epochs
        self.cooldown_epochs = cooldown_epochs
        self.scheduler = scheduler
        self.stability = PlateauDetector(patience=2, threshold=float(stability_level))
        self.max_gs = max_global_skips
        self.sending_chunk_size = sending_chunk_size
        self.cast_dtype = downcast_type
        self.skip_reduction_factor = skip_reduction_factor
        self.local_skip_factor = local_skip_factor
        self.verbose = verbose
        self.timeout = to_timedelta(timeout)
        self.device = _optimizer_device(local_optimizer)
        self.topology: DasoTopology = build_topology(size, self.device, self.timeout)
        self._group = group
        check_agreement(
            {
                "total_epochs": total_epochs,
                "warmup_epochs": warmup_epochs,
                "cooldown_epochs": cooldown_epochs,
                "stability_level": float(stability_level),
                "max_global_skips": max_global_skips,
                "sending_chunk_size": sending_chunk_size,
                "downcast_type": str(downcast_type),
                "skip_reduction_factor": skip_reduction_factor,
                "local_skip_factor": local_skip_factor,
            },
            group,
            self.device,
            "DASO",
        )
        #: Index of the final batch of an epoch (``len(loader) - 1``); must be set before :meth:`step`.
        self.last_batch: int | None = None
        self._one_thread = OneThreadAtATime("DASO")
        self.module: nn.Module | None = None
        self._tensors: list[torch.Tensor] = []
        self._scaler: Any = None
        self.reset()

    # --------------------------------------------------------------------------------------------- setup
    @property
    def local_group(self) -> dist.ProcessGroup:
        """The node-local process group (used by :class:`~pc_distributed.DataParallelMultiGPU`)."""
        return self.topology.local_group

    def set_model(self, model: nn.Module) -> None:
        """Attach the local model whose parameters and floating-point buffers DASO averages globally.

        Called by :class:`~pc_distributed.DataParallelMultiGPU`; a ``DistributedDataParallel`` or
        ``DataParallelMultiGPU`` wrapper is unwrapped.

        Args:
            model: The local model.

        Raises:
            TypeError: If ``model`` is not a module.
            ValueError: If the local optimizer holds tensors that are not the model's parameters.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        inner = model
        while hasattr(inner, "module") and isinstance(inner.module, nn.Module):
            inner = inner.module
        params = list(inner.parameters())
        known = {id(p) for p in params}
        for g in self.local_optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in known:
                    raise ValueError(
                        f"the local optimizer holds a tensor of shape {tuple(p.shape)} that is not a "
                        "parameter of the model; build it over model.parameters()"
                    )
        self.module = inner
        self._tensors = params + [b for b in inner.buffers() if b.is_floating_point()]
        self._ref = self._flat().clone()

    def add_scaler(self, scaler: Any) -> None:
        """Use a ``torch.amp.GradScaler``: :meth:`step` calls ``scaler.step(opt)`` and ``scaler.update()``.

        Args:
            scaler: The gradient scaler.
        """
        self._scaler = scaler

    def reset(self) -> None:
        """Return to the state after construction (epoch 0, no exchange in flight)."""
        self.epoch = 0
        self.current_batch = 0
        self._send_mod = 0
        self._pending: deque[Exchange] = deque()
        self.stability.reset()
        gs, ls, btw = next_skips(SkipState(0, 0, 0), 0, False, **self._schedule_kwargs())
        self.global_skip, self.local_skip, self.batches_to_wait = gs, ls, btw

    def _schedule_kwargs(self) -> dict[str, int]:
        return {
            "warmup_epochs": self.warmup_epochs,
            "cooldown_epochs": self.cooldown_epochs,
            "total_epochs": self.total_epochs,
            "max_global_skips": self.max_gs,
            "skip_reduction_factor": self.skip_reduction_factor,
            "local_skip_factor": self.local_skip_factor,
        }

    # ---------------------------------------------------------------------------------------- per batch
    def local_sync_due(self) -> bool:
        """Whether this batch's backward should average gradients inside the node (else ``DDP.no_sync``)."""
        ls = self.local_skip
        return ls <= 1 or self.current_batch % ls == 0 or self.current_batch == self.last_batch

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the local optimizer's gradients.

        Args:
            set_to_none: Set gradients to ``None`` instead of zeroing them.
        """
        self.local_optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """Step the local optimizer, then run this batch's part of the global synchronisation (collective).

        Raises:
            ValueError: If :attr:`last_batch` is not set.
            RuntimeError: If no model is attached (build :class:`~pc_distributed.DataParallelMultiGPU` first),
                or another thread of this process is inside ``step`` (one training thread per DASO).
        """
        with self._one_thread("step"):  # the global synchronisation is a collective
            if self.last_batch is None or self.last_batch < 0:
                raise ValueError(
                    f"set DASO.last_batch to the index of the epoch's final batch, got {self.last_batch!r}"
                )
            if self.module is None:
                raise RuntimeError("DASO has no model: wrap it with DataParallelMultiGPU(module, daso) first")
            if self._scaler is not None:
                self._scaler.step(self.local_optimizer)
                self._scaler.update()
            elif self.scheduler is not None:
                self.scheduler.step()
            else:
                self.local_optimizer.step()
            self._sync_after_step()

    @torch.no_grad()
    def _sync_after_step(self) -> None:
        b = self.current_batch
        if b == 0:
            self._check_epoch()
        while self._pending and self._pending[0].due <= b:
            self._complete(self._pending.popleft())
        if b >= int(self.last_batch or 0):
            while self._pending:
                self._complete(self._pending.popleft())
            self._complete(self._start(b, 0))
            self.current_batch = 0
            self._send_mod = 0
            self.epoch += 1
            return
        gs = self.global_skip
        if gs == 0 or b % gs == 0:
            staleness = 0 if gs == 0 else min(self.batches_to_wait, int(self.last_batch or 0) - b)
            exchange = self._start(b + staleness, staleness)
            if staleness == 0:
                self._complete(exchange)
            else:
                self._pending.append(exchange)
        self.current_batch += 1

    def _check_epoch(self) -> None:
        """Before an epoch's first exchange: check that every rank follows the same schedule (collective)."""
        check_agreement(
            {
                "the epoch": self.epoch,
                "last_batch": int(self.last_batch or 0),
                "the global skip": self.global_skip,
                "the local skip": self.local_skip,
                "batches_to_wait": self.batches_to_wait,
                "the averaged tensors (parameters, floating-point buffers)": [
                    (tuple(t.shape), str(t.dtype)) for t in self._tensors
                ],
            },
            self._group,
            self.device,
            "DASO",
        )

    def _flat(self) -> torch.Tensor:
        return flatten(self._tensors)

    def _start(self, due: int, staleness: int) -> Exchange:
        """Start an exchange due at batch ``due``; only the node's sender this time sends (asynchronously)."""
        sender = self._send_mod
        self._send_mod = (self._send_mod + 1) % self.topology.local_size
        exchange = Exchange(due=due, staleness=staleness, sender=sender)
        if self.topology.local_rank == sender:
            drift = (flatten(self._tensors) - self._ref).to(self.cast_dtype)
            exchange.send(drift, self.topology.column_group, self.sending_chunk_size)
        return exchange

    def _complete(self, exchange: Exchange) -> None:
        ref = complete_exchange(exchange, self._tensors, self._ref, self.topology, self.timeout)
        if ref is not None:
            self._ref = ref

    # ---------------------------------------------------------------------------------------- per epoch
    @torch.no_grad()
    def epoch_loss_logic(self, loss: torch.Tensor | float, loss_globally_averaged: bool = False) -> None:
        """Choose the next epoch's skips from the epoch's loss (collective unless already averaged).

        Call it once per epoch, after the epoch's last :meth:`step`.

        Args:
            loss: This rank's loss of the epoch (a number or a one-element tensor).
            loss_globally_averaged: ``True`` if ``loss`` already is the average over all ranks.

        Raises:
            FloatingPointError: If the averaged loss is NaN.
        """
        value = float(loss.detach().reshape(-1)[0]) if isinstance(loss, torch.Tensor) else float(loss)
        if not loss_globally_averaged:
            t = torch.tensor([value], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            value = float(t.item()) / dist.get_world_size()
        if math.isnan(value):
            raise FloatingPointError(f"the globally averaged loss of epoch {self.epoch} is NaN")
        cycling = (
            phase_of(self.epoch, self.warmup_epochs, self.cooldown_epochs, self.total_epochs) == "cycling"
        )
        plateaued = self.stability.step(value) if cycling else False
        current = SkipState(self.global_skip, self.local_skip, self.batches_to_wait)
        gs, ls, btw = next_skips(current, self.epoch, plateaued, **self._schedule_kwargs())
        self.global_skip, self.local_skip, self.batches_to_wait = gs, ls, btw
        self.print0(
            f"epoch {self.epoch}: loss {value:.5g}, plateau {plateaued}, next global skip {gs}, "
            f"local skip {ls}, batches to wait {btw}"
        )

    def print0(self, *args: Any) -> None:
        """Log ``args`` at INFO level on global rank 0 when ``verbose`` is set."""
        if self.verbose and dist.get_rank() == 0:
            logger.info(" ".join(str(a) for a in args))


def _optimizer_device(optimizer: torch.optim.Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return torch.device(p.device)
    raise ValueError("local_optimizer has no parameters")
