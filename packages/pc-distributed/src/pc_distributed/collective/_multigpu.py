"""The four ``*_multigpu`` collectives (removed from torch in 2.2) over a per-process list of tensors.

Each is a local reduction into one tensor of the list, one collective of the group, and a copy back to the
others. :class:`MultiGpuOps` is a base class of :class:`~pc_distributed.CollectiveGroup`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pc_distributed._one_thread import OneThreadAtATime
from pc_distributed.collective._work import ChainedWork

__all__ = ["MultiGpuOps"]

ReduceOp = dist.ReduceOp


class MultiGpuOps:
    """The ``*_multigpu`` methods; the group supplies :meth:`_pg`, :meth:`_check_rank` and :meth:`size`."""

    _one_thread: OneThreadAtATime  # the group's guard: its collectives are issued by one thread at a time

    def _pg(self) -> Any:
        raise NotImplementedError

    def _check_rank(self, label: str, rank: object) -> int:
        raise NotImplementedError

    def size(self) -> int:
        """Number of members."""
        raise NotImplementedError

    def all_reduce_multigpu(
        self, tensor_list: list[torch.Tensor], op: Any = ReduceOp.SUM, async_op: bool = False
    ) -> Any:
        """All-reduce over every tensor of every member's ``tensor_list``; all of them get the result.

        The list is reduced locally into ``tensor_list[0]``, one collective runs, and the result is copied
        back to the other entries. ``ReduceOp.AVG`` divides by ``size() * len(tensor_list)``.
        """
        pg = self._pg()
        _check_list("tensor_list", tensor_list)
        head = tensor_list[0]
        average = op == ReduceOp.AVG
        local_op = ReduceOp.SUM if average else op
        _reduce_into(head, tensor_list[1:], local_op)

        def finish() -> None:
            if average:
                head.div_(self.size() * len(tensor_list))
            for t in tensor_list[1:]:
                t.copy_(head)

        with self._one_thread("all_reduce_multigpu"):
            work = dist.all_reduce(head, op=local_op, group=pg, async_op=async_op)
        return _complete(work, finish, async_op)

    def broadcast_multigpu(
        self, tensor_list: list[torch.Tensor], src: int, async_op: bool = False, src_tensor: int = 0
    ) -> Any:
        """Broadcast ``tensor_list[src_tensor]`` of global rank ``src`` to every tensor of every member."""
        pg = self._pg()
        _check_list("tensor_list", tensor_list)
        _check_index("src_tensor", src_tensor, len(tensor_list))
        self._check_rank("src", src)
        head = tensor_list[src_tensor] if dist.get_rank() == src else tensor_list[0]

        def finish() -> None:
            for t in tensor_list:
                if t is not head:
                    t.copy_(head)

        with self._one_thread("broadcast_multigpu"):
            work = dist.broadcast(head, src, group=pg, async_op=async_op)
        return _complete(work, finish, async_op)

    def reduce_multigpu(
        self,
        tensor_list: list[torch.Tensor],
        dst: int,
        op: Any = ReduceOp.SUM,
        async_op: bool = False,
        dst_tensor: int = 0,
    ) -> Any:
        """Reduce every tensor of every member onto ``tensor_list[dst_tensor]`` of global rank ``dst``."""
        pg = self._pg()
        _check_list("tensor_list", tensor_list)
        _check_index("dst_tensor", dst_tensor, len(tensor_list))
        self._check_rank("dst", dst)
        head = tensor_list[dst_tensor]
        average = op == ReduceOp.AVG
        local_op = ReduceOp.SUM if average else op
        _reduce_into(head, [t for i, t in enumerate(tensor_list) if i != dst_tensor], local_op)

        def finish() -> None:
            if average and dist.get_rank() == dst:
                head.div_(self.size() * len(tensor_list))

        with self._one_thread("reduce_multigpu"):
            work = dist.reduce(head, dst, op=local_op, group=pg, async_op=async_op)
        return _complete(work, finish, async_op)

    def all_gather_multigpu(
        self,
        output_tensor_lists: list[list[torch.Tensor]],
        input_tensor_list: list[torch.Tensor],
        async_op: bool = False,
    ) -> Any:
        """Gather every member's ``input_tensor_list`` into each ``output_tensor_lists[i]``.

        Rank ``k``'s ``input_tensor_list[j]`` lands at ``output_tensor_lists[i][k * len(input_tensor_list) +
        j]`` (``k`` is the group rank; torch's old docs wrote ``k * world_size + j``, which was an error).
        """
        pg = self._pg()
        _check_list("input_tensor_list", input_tensor_list)
        n = len(input_tensor_list)
        need = self.size() * n
        for i, out in enumerate(output_tensor_lists):
            if len(out) != need:
                raise ValueError(
                    f"output_tensor_lists[{i}] must hold size()*len(input)={need} tensors, got {len(out)}"
                )
        stacked = torch.stack(list(input_tensor_list))
        gathered = [torch.empty_like(stacked) for _ in range(self.size())]

        def finish() -> None:
            for out in output_tensor_lists:
                for k in range(self.size()):
                    for j in range(n):
                        out[k * n + j].copy_(gathered[k][j])

        with self._one_thread("all_gather_multigpu"):
            work = dist.all_gather(gathered, stacked, group=pg, async_op=async_op)
        return _complete(work, finish, async_op)


def _check_list(label: str, tensors: object) -> None:
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ValueError(f"{label} must be a non-empty list of tensors, got {tensors!r}")
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{label} must hold tensors, got {type(t).__name__}")


def _check_index(label: str, index: object, length: int) -> None:
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < length:
        raise ValueError(f"{label} must be an int in [0, {length}), got {index!r}")


def _reduce_into(head: torch.Tensor, others: Sequence[torch.Tensor], op: Any) -> None:
    for t in others:
        other = t.to(head.device)
        if op == ReduceOp.SUM:
            head.add_(other)
        elif op == ReduceOp.PRODUCT:
            head.mul_(other)
        elif op == ReduceOp.MIN:
            torch.minimum(head, other, out=head)
        elif op == ReduceOp.MAX:
            torch.maximum(head, other, out=head)
        else:
            raise ValueError(f"op must be SUM, PRODUCT, MIN, MAX or AVG for *_multigpu, got {op!r}")


def _complete(work: Any, finish: Callable[[], None], async_op: bool) -> Any:
    if async_op:
        return ChainedWork(work, finish)
    finish()
    return None
