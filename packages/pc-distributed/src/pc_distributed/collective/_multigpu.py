"""The four ``*_multigpu`` collectives (removed from torch in 2.2) over a per-process list of tensors.

Each is a local reduction into one tensor of the list, one collective on the process group it is given, and a
copy back to the others. :class:`~pc_distributed.CollectiveGroup`'s ``*_multigpu`` methods check the ranks,
hold the group's one-thread guard and call these with the group's process group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pc_distributed.collective._work import ChainedWork

__all__ = ["all_gather_multigpu", "all_reduce_multigpu", "broadcast_multigpu", "reduce_multigpu"]

ReduceOp = dist.ReduceOp


def all_reduce_multigpu(pg: Any, tensor_list: list[torch.Tensor], op: Any, async_op: bool) -> Any:
    """All-reduce every tensor of every member's ``tensor_list`` on process group ``pg``.

    The list is reduced locally into ``tensor_list[0]``, one collective runs, and the result is copied back to
    the other entries. ``ReduceOp.AVG`` divides by ``size * len(tensor_list)``.
    """
    _check_list("tensor_list", tensor_list)
    head = tensor_list[0]
    average = op == ReduceOp.AVG
    local_op = ReduceOp.SUM if average else op
    _reduce_into(head, tensor_list[1:], local_op)
    size = dist.get_world_size(pg)

    def finish() -> None:
        if average:
            head.div_(size * len(tensor_list))
        for t in tensor_list[1:]:
            t.copy_(head)

    work = dist.all_reduce(head, op=local_op, group=pg, async_op=async_op)
    return _complete(work, finish, async_op)


def broadcast_multigpu(
    pg: Any, tensor_list: list[torch.Tensor], src: int, async_op: bool, src_tensor: int
) -> Any:
    """Broadcast ``tensor_list[src_tensor]`` of global rank ``src`` to every tensor of every member."""
    _check_list("tensor_list", tensor_list)
    _check_index("src_tensor", src_tensor, len(tensor_list))
    head = tensor_list[src_tensor] if dist.get_rank() == src else tensor_list[0]

    def finish() -> None:
        for t in tensor_list:
            if t is not head:
                t.copy_(head)

    work = dist.broadcast(head, src, group=pg, async_op=async_op)
    return _complete(work, finish, async_op)


def reduce_multigpu(
    pg: Any, tensor_list: list[torch.Tensor], dst: int, op: Any, async_op: bool, dst_tensor: int
) -> Any:
    """Reduce every tensor of every member onto ``tensor_list[dst_tensor]`` of global rank ``dst``."""
    _check_list("tensor_list", tensor_list)
    _check_index("dst_tensor", dst_tensor, len(tensor_list))
    head = tensor_list[dst_tensor]
    average = op == ReduceOp.AVG
    local_op = ReduceOp.SUM if average else op
    _reduce_into(head, [t for i, t in enumerate(tensor_list) if i != dst_tensor], local_op)
    size = dist.get_world_size(pg)

    def finish() -> None:
        if average and dist.get_rank() == dst:
            head.div_(size * len(tensor_list))

    work = dist.reduce(head, dst, op=local_op, group=pg, async_op=async_op)
    return _complete(work, finish, async_op)


def all_gather_multigpu(
    pg: Any,
    output_tensor_lists: list[list[torch.Tensor]],
    input_tensor_list: list[torch.Tensor],
    async_op: bool,
) -> Any:
    """Gather every member's ``input_tensor_list`` into each ``output_tensor_lists[i]`` on ``pg``.

    Rank ``k``'s ``input_tensor_list[j]`` lands at ``output_tensor_lists[i][k * len(input_tensor_list) + j]``
    (``k`` is the group rank).
    """
    _check_list("input_tensor_list", input_tensor_list)
    size = dist.get_world_size(pg)
    n = len(input_tensor_list)
    need = size * n
    for i, out in enumerate(output_tensor_lists):
        if len(out) != need:
            raise ValueError(
                f"output_tensor_lists[{i}] must hold size()*len(input)={need} tensors, got {len(out)}"
            )
    stacked = torch.stack(list(input_tensor_list))
    gathered = [torch.empty_like(stacked) for _ in range(size)]

    def finish() -> None:
        for out in output_tensor_lists:
            for k in range(size):
                for j in range(n):
                    out[k * n + j].copy_(gathered[k][j])

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
