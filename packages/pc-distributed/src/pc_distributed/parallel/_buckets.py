"""Gradient buckets reduced in a fixed order: the engine under :class:`~pc_distributed.DataParallel`.

Data flow of one synchronisation round::

    backward ──► post-accumulate hook(p) ──► mark(p): p.grad / world into its bucket's buffer, set used flag
                                               │
                     bucket full and every lower bucket launched?
                                               │ yes
                                               ▼
                                launch: async all_reduce(SUM) of the flat buffer
                                               │
    finish_all()/finish(i) ◄───────────────────┘  wait, hand the averages back

The buckets are fixed at construction and launched strictly in index order, so every rank issues the same
sequence of collectives even when gradients arrive in a different order or some parameters get none (those are
reduced as zeros when the round is closed by :meth:`GradReducer.launch_all`). Each bucket carries one extra
"used" counter per parameter: after the reduction a zero count means no rank produced a gradient for it, and
the parameter keeps ``grad = None`` exactly as in single-process training (so the optimizer skips it).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from pc_distributed.parallel._comm import wait_work

__all__ = ["Bucket", "GradReducer", "make_buckets"]


class Bucket:
    """A fixed set of same-device, same-dtype parameters reduced with one collective.

    Args:
        params: The parameters, in the order they are packed.
    """

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        if not params:
            raise ValueError("a bucket needs at least one parameter, got none")
        self.params = list(params)
        self.offsets: list[int] = []
        total = 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        first = self.params[0]
        # Payload followed by one "used" counter per parameter.
        self.flat = torch.zeros(total + len(self.params), dtype=first.dtype, device=first.device)
        # Views made once (the buffer never moves): a view per step would cost Python time on the hot path.
        self._slots = [
            self.flat[start : start + p.numel()].view_as(p)
            for start, p in zip(self.offsets, self.params, strict=True)
        ]
        self.counters = [self.flat[total + i : total + i + 1] for i in range(len(self.params))]
        self.marked: set[int] = set()
        self.work: object | None = None
        self.launched = False

    @property
    def full(self) -> bool:
        """Whether every parameter of the bucket has delivered its gradient this round."""
        return len(self.marked) == len(self.params)

    def slot(self, index: int) -> torch.Tensor:
        """The flat-buffer view that holds parameter ``index``'s gradient."""
        return self._slots[index]

    def reset(self) -> None:
        """Forget this round's state (the buffer is overwritten next round)."""
        self.marked.clear()
        self.work = None
        self.launched = False


def make_buckets(
    groups: Sequence[Sequence[nn.Parameter]], cap_bytes: int | None, first_cap_bytes: int | None = None
) -> list[Bucket]:
    """Build buckets from ordered parameter groups, splitting by device/dtype and at ``cap_bytes``.

    Args:
        groups: Parameter groups in launch order (e.g. one per module, or one holding every parameter).
        cap_bytes: The largest payload of one bucket in bytes, or ``None`` for no limit.
        first_cap_bytes: If given, the first bucket closes as soon as its payload reaches this many bytes
            (as ``DistributedDataParallel``'s small first bucket does), so the first reduction starts early in
            ``backward()`` and overlaps the rest of it.

    Returns:
        The buckets in launch order.
    """
    buckets: list[Bucket] = []
    for group in groups:
        current: list[nn.Parameter] = []
        size = 0
        for p in group:
            nbytes = p.numel() * p.element_size()
            kind_changes = bool(current) and (current[0].dtype, current[0].device) != (p.dtype, p.device)
            too_big = cap_bytes is not None and bool(current) and size + nbytes > cap_bytes
            if kind_changes or too_big:
                buckets.append(Bucket(current))
                current, size = [], 0
            current.append(p)
            size += nbytes
            if first_cap_bytes is not None and not buckets and size >= first_cap_bytes:
                buckets.append(Bucket(current))
                current, size = [], 0
        if current:
            buckets.append(Bucket(current))
    return buckets


class GradReducer:
    """Averages gradients over a process group bucket by bucket, always launching in bucket order.

    Args:
        buckets: The buckets in launch order.
        group: The process group.
        timeout: The bound on each wait, or ``None`` for the process group's timeout.
        take_grads: If true, :meth:`mark` moves ``p.grad`` into the bucket and sets ``p.grad = None``
            (non-blocking mode); if false it copies and leaves ``p.grad`` alone (blocking mode).
    """

    def __init__(
        self,
        buckets: Sequence[Bucket],
        group: dist.ProcessGroup,
        timeout: timedelta | None,
        *,
        take_grads: bool,
    ) -> None:
        self.buckets = list(buckets)
        self.group = group
        self.world = int(dist.get_world_size(group))
        self.timeout = timeout
        self.take_grads = take_grads
        self.where: dict[int, tuple[int, int]] = {}
        for bi, b in enumerate(self.buckets):
            for pi, p in enumerate(b.params):
                self.where[id(p)] = (bi, pi)
        self.next_launch = 0
        self.open = False
        #: How many rounds have been opened so far (a round opens with its first gradient).
        self.rounds = 0

    def params(self) -> Iterator[nn.Parameter]:
        """Every parameter handled by the reducer, in bucket order."""
        for b in self.buckets:
            yield from b.params

    @torch.no_grad()
    def mark(self, p: nn.Parameter) -> None:
        """Record ``p``'s accumulated gradient for this round and launch whatever became launchable.

        Raises:
            RuntimeError: If ``p`` already delivered a gradient this round and its bucket is in flight.
        """
        bi, pi = self.where[id(p)]
        bucket = self.buckets[bi]
        if pi in bucket.marked or bi < self.next_launch:
            raise RuntimeError(
                f"a parameter of shape {tuple(p.shape)} received a second gradient before its previous one "
                "was reduced; call optimizer.step() or flush() between backward passes, or use no_sync() to "
                "accumulate gradients"
            )
        self._pack(bucket, pi, p)
        self.open_round()
        self.launch_ready()

    def open_round(self) -> None:
        """Open a round if none is open; :meth:`launch_all` then packs every parameter's ``p.grad`` or zeros.

        A rank whose backward reached no parameter opens its round this way, so that it still issues the
        round's collectives that the other ranks issue.
        """
        if not self.open:
            self.open = True
            self.rounds += 1

    def is_marked(self, p: nn.Parameter) -> bool:
        """Whether ``p`` already delivered its gradient (or its absence) this round."""
        bi, pi = self.where[id(p)]
        return pi in self.buckets[bi].marked or bi < self.next_launch

    def _pack(self, bucket: Bucket, pi: int, p: nn.Parameter) -> None:
        slot = bucket.slot(pi)
        counter = bucket.counters[pi]
        if p.grad is None:
            slot.zero_()
            counter.zero_()
        else:
            # Divided while packed (one pass instead of a copy and a later in-place division).
            torch.div(p.grad, self.world, out=slot)
            counter.fill_(1)
            if self.take_grads:
                p.grad = None
        bucket.marked.add(pi)

    def launch_ready(self) -> None:
        """Launch every full bucket whose predecessors have all been launched."""
        while self.next_launch < len(self.buckets) and self.buckets[self.next_launch].full:
            self._launch(self.buckets[self.next_launch])

    @torch.no_grad()
    def launch_all(self) -> None:
        """Close the round: pack what is missing (``p.grad`` or zeros) and launch every remaining bucket."""
        if not self.open:
            return
        while self.next_launch < len(self.buckets):
            bucket = self.buckets[self.next_launch]
            for pi, p in enumerate(bucket.params):
                if pi not in bucket.marked:
                    self._pack(bucket, pi, p)
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)
        bucket.launched = True
        self.next_launch += 1

    @property
    def all_launched(self) -> bool:
        """Whether every bucket of the open round has been launched."""
        return self.open and self.next_launch == len(self.buckets)

    def pending(self, index: int) -> bool:
        """Whether bucket ``index`` holds a launched reduction that has not been handed back yet."""
        return self.buckets[index].launched

    @torch.no_grad()
    def finish(self, index: int, *, copy: bool = True) -> list[tuple[nn.Parameter, torch.Tensor | None]]:
        """Wait for bucket ``index`` and return ``(param, averaged_grad or None)`` pairs.

        ``None`` means no rank produced a gradient for that parameter. With ``copy`` (the default) the
        returned tensors are fresh; without it they are views of the bucket buffer, valid until the bucket's
        next round (the caller copies them out at once). When the last pending bucket is finished, the round
        closes.
        """
        bucket = self.buckets[index]
        if not bucket.launched:
            raise RuntimeError(f"bucket {index} has no reduction in flight")
        wait_work(bucket.work, self.timeout)
        counts = bucket.flat[bucket.numel :].tolist()  # one read of every "used" counter
        out: list[tuple[nn.Parameter, torch.Tensor | None]] = []
        for pi, p in enumerate(bucket.params):
            if counts[pi] > 0.5:
                view = bucket.slot(pi)
                out.append((p, view.clone() if copy else view))
            else:
                out.append((p, None))
        bucket.reset()
        if self.open and self.next_launch == len(self.buckets) and not any(b.launched for b in self.buckets):
            self.open = False
            self.next_launch = 0
        return out
