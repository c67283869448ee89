"""``DataParallel`` on torch.distributed groups: blocking and non-blocking (deferred) updates.

Construction (collective on every member of the group)::

    mode and bucket plan ──► check_replicas ──► broadcast parameters and buffers from group rank 0 ──► hooks

The check compares, in one all_gather, the model's structure, the mode after any fallback, the bucket plan
and ``broadcast_buffers``: what decides which collectives a rank issues and how many bytes each carries. A
difference is a ``ValueError`` on every rank, not a gloo abort or silently summed unlike tensors.

Blocking mode: gradients are averaged in fixed-order buckets while ``backward()`` runs; when the last bucket
arrives the averages are written into ``p.grad``, so ``optimizer.step()`` updates every replica identically.

Non-blocking mode (a deferred, layer-by-layer update): each parameter-owning module's gradients form one
bucket whose reduction starts as soon as it is complete; ``optimizer.step()`` only marks a step as due. The
next forward's pre-hook on each module waits for that module's reduction, steps the optimizer for its
parameters only (optimizers skip ``None`` gradients) and clears them. What the forward did not reach is
applied right after it, and by :meth:`DataParallel.flush`, ``eval()`` and ``state_dict()``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from pc_distributed._checks import bool_flag, optional_timeout, positive_number
from pc_distributed._one_thread import OneThreadAtATime
from pc_distributed.parallel._buckets import Bucket, GradReducer, make_buckets
from pc_distributed.parallel._comm import (
    CommLike,
    broadcast_tensors,
    check_replicas,
    resolve_group,
    to_timedelta,
)
from pc_distributed.parallel.optimizer import DataParallelOptimizer

__all__ = ["DataParallel"]

logger = logging.getLogger(__name__)


def _as_optimizer_list(optimizer: Any) -> list[DataParallelOptimizer]:
    if optimizer is None:
        raise TypeError(
            "DataParallel needs optimizer=DataParallelOptimizer(torch_optimizer) (or a list/tuple of them), "
            "got None"
        )
    items = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not items:
        raise TypeError(
            "optimizer must be a DataParallelOptimizer or a non-empty list/tuple of them, got an empty one"
        )
    for item in items:
        if isinstance(item, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be wrapped: pass DataParallelOptimizer({type(item).__name__}(...)), got "
                "the bare torch optimizer"
            )
        if not isinstance(item, DataParallelOptimizer):
            raise TypeError(f"optimizer must be a DataParallelOptimizer, got {type(item).__name__}")
    return items


def _optimizer_error(
    optimizers: Sequence[DataParallelOptimizer], trainable: Sequence[nn.Parameter]
) -> Exception | None:
    """An error if some optimizer holds a tensor that is not a trainable parameter of the module."""
    if not trainable:
        return ValueError(
            "the module has no trainable parameters (requires_grad=True); nothing to train in parallel"
        )
    known = {id(p) for p in trainable}
    for i, opt in enumerate(optimizers):
        for group in opt.torch_optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in known:
                    return ValueError(
                        f"optimizer {i} holds a tensor of shape {tuple(p.shape)} that is not a trainable "
                        "parameter of the module; build the optimizer over module.parameters()"
                    )
    return None


def _blocking_reason(
    optimizers: Sequence[DataParallelOptimizer], trainable: Sequence[nn.Parameter]
) -> str | None:
    """Why non-blocking updates cannot be used with these optimizers, or ``None`` if they can."""
    if len(optimizers) > 1:
        return f"{len(optimizers)} optimizers were given"
    torch_opt = optimizers[0].torch_optimizer
    if isinstance(torch_opt, torch.optim.LBFGS):
        return "LBFGS needs all gradients at once (and a closure)"
    covered = {id(p) for g in torch_opt.param_groups for p in g["params"]}
    if covered != {id(p) for p in trainable}:
        return "the optimizer does not hold exactly the module's trainable parameters"
    return None


def _layer_groups(module: nn.Module) -> list[list[nn.Parameter]]:
    """Non-blocking mode's bucket groups: one per parameter-owning module, in reverse module order.

    A tied parameter goes to its first owner.
    """
    seen: set[int] = set()
    per_module: list[list[nn.Parameter]] = []
    for sub in module.modules():
        own = [p for p in sub.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in own)
        per_module.append(own)
    return [own for own in reversed(per_module) if own]


def _plan(buckets: Sequence[Bucket]) -> str:
    """What the buckets' all-reduces carry, in launch order: each bucket's parameters' shapes and dtype."""
    return repr([(str(b.params[0].dtype), [tuple(p.shape) for p in b.params]) for b in buckets])


class DataParallel(nn.Module):
    """Data parallelism across the processes of a torch.distributed group.

    Every rank runs the same model on its own share of the data. Replicas start identical (parameters and
    buffers are broadcast from the group's first rank, so pretrained weights and RNG streams survive) and stay
    identical: gradients are averaged over the group, and in training mode buffers (e.g. BatchNorm running
    statistics) are re-broadcast from the first rank before each forward, as ``DistributedDataParallel`` does
    by default.

    Construction and every synchronising call are collective: all members of the group must make them, in the
    same order, the same number of times (one ``backward()`` per rank per round).

    Args:
        module: The local replica. All ranks must build the same architecture (checked at construction).
        comm: A :class:`pc_distributed.CollectiveGroup`, a ``torch.distributed.ProcessGroup`` or ``None`` for
            the default (world) group.
        optimizer: A :class:`DataParallelOptimizer` (or a list/tuple of them) over the module's parameters. It
            is only declared ``None`` by default for Python's syntax; ``None`` raises ``TypeError``.
        blocking_parameter_updates: ``True``: average during ``backward()`` and step immediately. ``False``
            (default): non-blocking mode, which overlaps the reduction with the next forward. Several
            optimizers, LBFGS or an optimizer over only part of the parameters fall back to blocking with a
            warning.
        broadcast_buffers: Re-broadcast buffers from the first rank before each training forward.
        bucket_cap_mb: Largest gradient bucket in blocking mode, in MiB. Buckets are all-reduced while
            ``backward()`` still runs, in reverse parameter order, as each one fills.
        first_bucket_cap_mb: Blocking mode's first bucket closes once it holds this many MiB (1 MiB, as in
            ``DistributedDataParallel``), so the first all-reduce starts early in ``backward()``.
        timeout: Seconds to wait for one reduction, or ``None`` for the process group's timeout.

    Raises:
        TypeError: If an argument has the wrong type (e.g. a bare torch optimizer or ``None``).
        ValueError: If the module has no trainable parameters, an optimizer holds foreign tensors, or the
            models differ across ranks (on every rank, so none is left waiting).
        RuntimeError: If torch.distributed is not initialised.

    Examples:
        >>> opt = DataParallelOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))  # doctest: +SKIP
        >>> dp = DataParallel(model, optimizer=opt, blocking_parameter_updates=True)  # doctest: +SKIP
        >>> loss_fn(dp(x), y).backward(); opt.step(); opt.zero_grad()  # doctest: +SKIP
    """

    def __init__(
        self,
        module: nn.Module,
        comm: CommLike = None,
        optimizer: DataParallelOptimizer | Sequence[DataParallelOptimizer] | None = None,
        blocking_parameter_updates: bool = False,
        *,
        broadcast_buffers: bool = True,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        timeout: float | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        bool_flag("blocking_parameter_updates", blocking_parameter_updates)
        positive_number("bucket_cap_mb", bucket_cap_mb)
        positive_number("first_bucket_cap_mb", first_bucket_cap_mb)
        timeout = optional_timeout("timeout", timeout)  # None (or -1): the group's timeout
        optimizers = _as_optimizer_list(optimizer)
        group = resolve_group(comm)

        trainable = [p for p in module.parameters() if p.requires_grad]
        tensors = [*module.parameters(), *module.buffers()]
        device = tensors[0].device if tensors else torch.device("cpu")
        reason = None if blocking_parameter_updates else _blocking_reason(optimizers, trainable)
        blocking = blocking_parameter_updates or reason is not None
        if blocking:
            cap = int(bucket_cap_mb * 2**20)
            # A small first bucket (as DDP's) starts the first reduction early, overlapping most of backward.
            first = min(cap, int(first_bucket_cap_mb * 2**20))
            buckets = make_buckets([list(reversed(trainable))], cap, first)
        else:
            buckets = make_buckets(_layer_groups(module), None)
        settings = {
            "the mode (blocking_parameter_updates after any fallback to blocking)": blocking,
            "broadcast_buffers": bool(broadcast_buffers),
            "the gradient bucket plan (bucket_cap_mb, first_bucket_cap_mb)": _plan(buckets),
        }
        check_replicas(module, group, device, _optimizer_error(optimizers, trainable), settings)
        broadcast_tensors(tensors, group)
        if reason is not None:
            warnings.warn(f"DataParallel falls back to blocking parameter updates: {reason}", stacklevel=2)

        self.module = module
        self._trainable = trainable
        self.comm = comm
        self.blocking_parameter_updates = blocking
        self.broadcast_buffers = broadcast_buffers
        self._group = group
        self._one_thread = OneThreadAtATime("DataParallel")
        self._optimizers = optimizers
        self._sync = True
        self._module_buckets: dict[int, list[int]] = {}
        self._pre_handles: list[Any] = []
        self._rounds_at_step = 0  # the reducer's round count at the last optimizer step
        for opt in optimizers:
            opt.blocking_parameter_updates = blocking
            opt.update_next = False
            opt._owner = self

        wait = to_timedelta(timeout)
        self._reducer = GradReducer(buckets, group, wait, take_grads=not blocking)
        if not blocking:
            self._wait_before_forward(module)
        # When backward has computed every gradient it will compute, parameters outside its graph are marked
        # as "no gradient this round", so their buckets complete and blocking mode finishes inside backward.
        self._multi_handle = torch.autograd.graph.register_multi_grad_hook(trainable, self._graph_done_hook)
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(self._grad_hook)  # type: ignore[no-untyped-call]
            for p in trainable
        ]
        logger.debug(
            "DataParallel: %d parameters in %d buckets, %s mode",
            len(trainable),
            len(self._reducer.buckets),
            "blocking" if blocking else "non-blocking",
        )

    def _wait_before_forward(self, module: nn.Module) -> None:
        """Non-blocking mode: each module's forward first waits for the buckets of its parameters."""
        reducer = self._reducer
        # A module waits for every bucket holding a parameter registered on it (its tied ones included).
        for sub in module.modules():
            indices = sorted(
                {reducer.where[id(p)][0] for p in sub.parameters(recurse=False) if id(p) in reducer.where}
            )
            if indices and id(sub) not in self._module_buckets:
                self._module_buckets[id(sub)] = indices
                self._pre_handles.append(sub.register_forward_pre_hook(self._pre_forward_hook))

    # ----------------------------------------------------------------------------------------------- hooks
    def _grad_hook(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        self._reducer.mark(p)  # type: ignore[arg-type]
        if self.blocking_parameter_updates and self._reducer.all_launched:
            self._finish_blocking_round()

    def _graph_done_hook(self, grads: Sequence[torch.Tensor | None]) -> None:
        if not self._sync:
            return
        for p, g in zip(self._trainable, grads, strict=True):
            if g is None and not self._reducer.is_marked(p):
                self._reducer.mark(p)
        if self.blocking_parameter_updates and self._reducer.all_launched:
            self._finish_blocking_round()

    def _pre_forward_hook(self, module: nn.Module, args: Any) -> None:
        for index in self._module_buckets.get(id(module), ()):
            if self._reducer.pending(index):
                self._apply_bucket(index)

    # --------------------------------------------------------------------------------------------- rounds
    @torch.no_grad()
    def _finish_blocking_round(self) -> None:
        """Launch what is left, wait for every bucket and write the averages into ``p.grad``."""
        self._reducer.launch_all()
        for index in range(len(self._reducer.buckets)):
            if not self._reducer.pending(index):
                continue
            for p, avg in self._reducer.finish(index, copy=False):
                if avg is None:
                    continue
                if p.grad is None:
                    p.grad = avg.clone()
                else:
                    p.grad.copy_(avg)

    @torch.no_grad()
    def _apply_bucket(self, index: int) -> None:
        """Non-blocking mode: hand bucket ``index``'s averages to its parameters, stepping them if due."""
        results = self._reducer.finish(index)
        for p, avg in results:
            if avg is not None:
                p.grad = avg
        optimizer = self._optimizers[0]
        if optimizer.update_next:
            optimizer.torch_optimizer.step()
            for p, _ in results:
                p.grad = None

    def _apply_all(self) -> None:
        self._reducer.launch_all()
        for index in range(len(self._reducer.buckets)):
            if self._reducer.pending(index):
                self._apply_bucket(index)
        self._optimizers[0].update_next = False

    def _before_optimizer_step(self) -> None:
        if self._sync and not self._reducer.open and self._reducer.rounds == self._rounds_at_step:
            # No backward of this rank reached a parameter since the last step (a loss that does not depend
            # on the model, a skipped backward), while the other ranks' did and wait for this rank in their
            # round: take part in it with what this rank has (its gradients, or none: zeros).
            self._reducer.open_round()
        self._rounds_at_step = self._reducer.rounds
        if self.blocking_parameter_updates:
            self._finish_blocking_round()
        else:
            self._reducer.launch_all()

    def _before_zero_grad(self, update_pending: bool) -> None:
        if update_pending and not self.blocking_parameter_updates:
            return
        # Gradients are being discarded: complete the collectives every rank issues, drop their results.
        self._reducer.launch_all()
        for index in range(len(self._reducer.buckets)):
            if self._reducer.pending(index):
                self._reducer.finish(index)

    # ----------------------------------------------------------------------------------------- public API
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Apply what is pending from the last step, sync buffers (training mode) and run the local module.

        Args:
            *inputs: Positional inputs of the wrapped module.
            **kwargs: Keyword inputs of the wrapped module.

        Returns:
            The wrapped module's output.

        Raises:
            RuntimeError: Another thread of this process is inside this wrapper's ``forward`` (one training
                thread per wrapper: the collectives must be issued in the same order on every rank).
        """
        with self._one_thread("forward"):  # its collectives must be issued in the same order on every rank
            if self.blocking_parameter_updates:
                if self._reducer.open:
                    self._finish_blocking_round()
            else:
                self._reducer.launch_all()
            if self.training and self.broadcast_buffers:
                broadcast_tensors(list(self.module.buffers()), self._group)
            out = self.module(*inputs, **kwargs)
            if not self.blocking_parameter_updates:
                self._apply_all()
            return out

    def flush(self) -> None:
        """Finish every reduction in flight and apply what is pending (a due non-blocking step included).

        Collective: every rank must call it. ``eval()`` and ``state_dict()`` call it for you. With
        ``broadcast_buffers`` it also re-broadcasts the buffers from the first rank, so evaluation and
        checkpoints see the same running statistics on every rank.
        """
        if self.blocking_parameter_updates:
            if self._reducer.open:
                self._finish_blocking_round()
        else:
            self._apply_all()
        if self.broadcast_buffers:
            broadcast_tensors(list(self.module.buffers()), self._group)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes inside the context do not communicate.

        The next backward outside the context averages everything accumulated, as with
        ``DistributedDataParallel.no_sync``.
        """
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    def train(self, mode: bool = True) -> DataParallel:
        """Set training mode; leaving it flushes pending updates first (collective).

        Args:
            mode: ``True`` for training, ``False`` for evaluation.

        Returns:
            ``self``.
        """
        if not mode and hasattr(self, "_reducer"):
            self.flush()
        super().train(mode)
        return self

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped state (under ``module.``) after :meth:`flush` (collective)."""
        self.flush()
        return super().state_dict(*args, **kwargs)

    def remove_hooks(self) -> None:
        """Flush, then detach every hook from the wrapped module (it becomes a plain local module again)."""
        self.flush()
        for handle in [*self._hook_handles, *self._pre_handles, self._multi_handle]:
            handle.remove()
        self._hook_handles = []
        self._pre_handles = []
