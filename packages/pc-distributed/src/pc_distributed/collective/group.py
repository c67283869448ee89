"""CollectiveGroup: torch.distributed's collectives on one process group, with global ranks and timeouts.

The only additions over torch are an any-source ``irecv`` whose ``wait()`` returns the sender (``_work``), and
the four ``*_multigpu`` functions removed from torch in 2.2 (``_multigpu``). The group is created through its
World (:func:`create_collective_group`), which it does not import: it sees it as a ``GroupHost``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

import pc_distributed.collective._multigpu as _multigpu
from pc_distributed import _torch_dist
from pc_distributed._host import GroupHost
from pc_distributed._one_thread import OneThreadAtATime
from pc_distributed._store import wait_keys
from pc_distributed.collective._work import RecvHandle

__all__ = ["CollectiveGroup", "RecvHandle", "create_collective_group"]

ReduceOp = dist.ReduceOp


class CollectiveGroup:
    """A thin wrapper of torch.distributed's collectives on one process group; ranks are global, as in torch.

    Do not construct it yourself: use :meth:`World.create_collective_group`, which every world rank must call.
    On a rank outside the group every method raises ``RuntimeError``.

    Args:
        group: The torch process group (or ``GroupMember.NON_GROUP_MEMBER``).
        current_relative_rank: This process's rank inside the group (-1 outside it).
        ranks: Global ranks of the members, sorted.
        timeout: Seconds, the group's collective timeout.
    """

    def __init__(
        self, group: Any, current_relative_rank: int, ranks: Sequence[int] = (), timeout: float = 60.0
    ) -> None:
        self.group = group
        self.current_relative_rank = current_relative_rank
        self.ranks = list(ranks)
        self.timeout = timeout
        self.destroyed = False
        self._one_thread = OneThreadAtATime(f"collective group {self.ranks}")

    # -- helpers ---
    def _pg(self) -> Any:
        if self.destroyed:
            raise RuntimeError(f"collective group {self.ranks} has been destroyed")
        if self.current_relative_rank < 0:
            raise RuntimeError(
                f"this process (rank {dist.get_rank()}) is not a member of the collective group {self.ranks}"
            )
        return self.group

    def _check_rank(self, label: str, rank: object) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"{label} must be an int global rank, got {rank!r} ({type(rank).__name__})")
        if rank not in self.ranks:
            raise ValueError(f"{label} must be a member's global rank {self.ranks}, got {rank}")
        return rank

    def _forget(self) -> None:
        self.destroyed = True

    def size(self) -> int:
        """Number of members."""
        return len(self.ranks)

    def is_member(self, rank: int | None = None) -> bool:
        """Whether ``rank`` (default: this process) is a member."""
        if rank is None:
            return self.current_relative_rank >= 0
        return rank in self.ranks

    def destroy(self) -> None:
        """Destroy the group's process group (idempotent). Members should call it together."""
        if self.destroyed:
            return
        self.destroyed = True
        if self.current_relative_rank >= 0 and dist.is_initialized():
            dist.destroy_process_group(self.group)

    # -- point to point ---
    # A tensor on a device the group's backend cannot send from (a CUDA tensor on gloo, whose point-to-point
    # ops would abort the process) goes through a host copy: sent from a CPU copy, received into a CPU buffer
    # that is copied into the tensor once the receive completes.
    @staticmethod
    def _host_staged(pg: Any, tensor: torch.Tensor) -> bool:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        return not _torch_dist.p2p_carries(str(dist.get_backend(pg)), tensor.device.type)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to global rank ``dst`` (through a host copy where the backend needs one)."""
        pg = self._pg()
        dst = self._check_rank("dst", dst)
        dist.send(tensor.cpu() if self._host_staged(pg, tensor) else tensor, dst, group=pg, tag=tag)

    def recv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> int:
        """Receive into ``tensor`` from ``src`` (None: any member); return the sender's global rank."""
        pg = self._pg()
        if src is not None:
            self._check_rank("src", src)
        if not self._host_staged(pg, tensor):
            return int(dist.recv(tensor, src=src, group=pg, tag=tag))
        host = torch.empty(tensor.shape, dtype=tensor.dtype)
        sender = int(dist.recv(host, src=src, group=pg, tag=tag))
        tensor.copy_(host)
        return sender

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Any:
        """Send ``tensor`` asynchronously; returns a request with ``wait()``.

        Where the backend needs a host copy, the copy is made before this returns, so the tensor may change
        at once.
        """
        pg = self._pg()
        dst = self._check_rank("dst", dst)
        return dist.isend(tensor.cpu() if self._host_staged(pg, tensor) else tensor, dst, group=pg, tag=tag)

    def irecv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> RecvHandle:
        """Receive asynchronously; ``wait(timeout=None)`` on the result returns the sender's global rank.

        ``src=None`` receives from any member (gloo and MPI only). Where the backend needs a host copy, the
        received values are in ``tensor`` once ``wait()`` has returned.
        """
        pg = self._pg()
        if src is not None:
            self._check_rank("src", src)
        target = tensor
        finish = None
        if self._host_staged(pg, tensor):
            target = torch.empty(tensor.shape, dtype=tensor.dtype)
            finish = functools.partial(tensor.copy_, target)
        if src is None:
            return RecvHandle.any_source(target, pg, tag, self.timeout, finish=finish)
        work = dist.irecv(target, src=src, group=pg, tag=tag)
        return RecvHandle(src, work, self.timeout, finish=finish)

    # -- collectives ---
    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Any:
        """Broadcast ``tensor`` from global rank ``src`` to every member."""
        with self._one_thread("broadcast"):
            return dist.broadcast(tensor, self._check_rank("src", src), group=self._pg(), async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, op: Any = ReduceOp.SUM, async_op: bool = False) -> Any:
        """Reduce ``tensor`` in place across all members; every member gets the result."""
        with self._one_thread("all_reduce"):
            return dist.all_reduce(tensor, op=op, group=self._pg(), async_op=async_op)

    def reduce(self, tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, async_op: bool = False) -> Any:
        """Reduce ``tensor`` onto global rank ``dst``."""
        with self._one_thread("reduce"):
            return dist.reduce(
                tensor, self._check_rank("dst", dst), op=op, group=self._pg(), async_op=async_op
            )

    def all_gather(
        self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, async_op: bool = False
    ) -> Any:
        """Gather ``tensor`` from every member into ``tensor_list`` (ordered by group rank)."""
        with self._one_thread("all_gather"):
            return dist.all_gather(tensor_list, tensor, group=self._pg(), async_op=async_op)

    def gather(
        self,
        tensor: torch.Tensor,
        gather_list: list[torch.Tensor] | None = None,
        dst: int = 0,
        async_op: bool = False,
    ) -> Any:
        """Gather ``tensor`` from every member into ``gather_list`` on global rank ``dst``."""
        with self._one_thread("gather"):
            return dist.gather(
                tensor, gather_list, dst=self._check_rank("dst", dst), group=self._pg(), async_op=async_op
            )

    def scatter(
        self,
        tensor: torch.Tensor,
        scatter_list: list[torch.Tensor] | None = None,
        src: int = 0,
        async_op: bool = False,
    ) -> Any:
        """Scatter ``scatter_list`` from global rank ``src``: member i receives ``scatter_list[i]``."""
        with self._one_thread("scatter"):
            return dist.scatter(
                tensor, scatter_list, src=self._check_rank("src", src), group=self._pg(), async_op=async_op
            )

    def barrier(self, async_op: bool = False) -> Any:
        """Synchronise all members."""
        with self._one_thread("barrier"):
            return dist.barrier(group=self._pg(), async_op=async_op)

    # -- the *_multigpu collectives (removed from torch in 2.2) over a per-process list of tensors ---
    def all_reduce_multigpu(
        self, tensor_list: list[torch.Tensor], op: Any = ReduceOp.SUM, async_op: bool = False
    ) -> Any:
        """All-reduce over every tensor of every member's ``tensor_list``; all of them get the result.

        The list is reduced locally into ``tensor_list[0]``, one collective runs, and the result is copied
        back to the other entries. ``ReduceOp.AVG`` divides by ``size() * len(tensor_list)``.
        """
        pg = self._pg()
        with self._one_thread("all_reduce_multigpu"):
            return _multigpu.all_reduce_multigpu(pg, tensor_list, op, async_op)

    def broadcast_multigpu(
        self, tensor_list: list[torch.Tensor], src: int, async_op: bool = False, src_tensor: int = 0
    ) -> Any:
        """Broadcast ``tensor_list[src_tensor]`` of global rank ``src`` to every tensor of every member."""
        pg = self._pg()
        self._check_rank("src", src)
        with self._one_thread("broadcast_multigpu"):
            return _multigpu.broadcast_multigpu(pg, tensor_list, src, async_op, src_tensor)

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
        self._check_rank("dst", dst)
        with self._one_thread("reduce_multigpu"):
            return _multigpu.reduce_multigpu(pg, tensor_list, dst, op, async_op, dst_tensor)

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
        with self._one_thread("all_gather_multigpu"):
            return _multigpu.all_gather_multigpu(pg, output_tensor_lists, input_tensor_list, async_op)

    def __reduce__(self) -> NoReturn:
        raise TypeError("CollectiveGroup wraps a process group of this process and cannot be pickled")

    def __repr__(self) -> str:
        return f"CollectiveGroup(ranks={self.ranks}, member={self.current_relative_rank >= 0})"


def create_collective_group(
    world: GroupHost, ranks: Sequence[int], timeout: float, backend: str | None
) -> CollectiveGroup:
    """Check through the store that all world ranks entered with the same ``ranks``; call ``new_group``."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise TypeError(f"ranks must be a sequence of ints, got {type(ranks).__name__} {ranks!r}")
    members = sorted(ranks)
    if not members or len(set(members)) != len(members):
        raise ValueError(f"ranks must be non-empty and unique, got {list(ranks)}")
    for r in members:
        what = f"ranks must be ints in [0, {world.world_size}), got {list(ranks)}"
        if isinstance(r, bool) or not isinstance(r, int):
            raise TypeError(what)
        if not 0 <= r < world.world_size:
            raise ValueError(what)
    seq = world.next_collective_seq()
    store, text = world.store, ",".join(map(str, members))
    store.set(f"cg/{seq}/{world.rank}", text)
    keys = [f"cg/{seq}/{r}" for r in range(world.world_size)]
    try:
        wait_keys(
            store,
            world.waits,
            keys,
            timeout,
            f"create_collective_group #{seq} (every world rank must call it)",
        )
    except TimeoutError as exc:
        missing = [r for r in range(world.world_size) if not store.check([f"cg/{seq}/{r}"])]
        raise TimeoutError(
            f"create_collective_group({members}) timed out after {timeout:g} s: world ranks {missing} "
            "did not call it (every world rank must, members or not)"
        ) from exc
    seen = {r: store.get(f"cg/{seq}/{r}").decode() for r in range(world.world_size)}
    if any(v != text for v in seen.values()):
        raise ValueError(f"ranks disagree on create_collective_group #{seq}: {seen} (rank: ranks)")
    pg = _torch_dist.new_group(members, timeout, backend)
    relative = members.index(world.rank) if world.rank in members else -1
    group = CollectiveGroup(pg, relative, members, timeout)
    world.attach_collective_group(group)
    return group
