"""CollectiveGroup: torch.distributed's collectives on one process group, with global ranks and timeouts.

The only additions over torch are an any-source ``irecv`` whose ``wait()`` returns the sender, and the four
``*_multigpu`` functions (removed from torch in 2.2) re-implemented over a per-process tensor list: a local
reduction, one collective, and a copy back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist

from pc_distributed._store import wait_keys

if TYPE_CHECKING:
    from pc_distributed.world import World

__all__ = ["CollectiveGroup", "RecvHandle", "create_collective_group"]

ReduceOp = dist.ReduceOp


class RecvHandle:
    """What :meth:`CollectiveGroup.irecv` returns: ``wait(timeout=None)`` returns the sender's global rank."""

    def __init__(self, src: int | None, work: Any = None, timeout: float = 60.0) -> None:
        self._src = src
        self._work = work
        self._timeout = timeout
        self._done = threading.Event()
        self._error: BaseException | None = None

    @classmethod
    def any_source(cls, tensor: torch.Tensor, pg: Any, tag: int, timeout: float) -> RecvHandle:
        """Post a receive from any source in a daemon thread (torch reveals the sender only to ``recv``)."""
        handle = cls(None, None, timeout)

        def receive() -> None:
            try:
                handle._src = dist.recv(tensor, src=None, group=pg, tag=tag)
            except BaseException as exc:
                handle._error = exc
            finally:
                handle._done.set()

        threading.Thread(target=receive, name="pc-distributed-irecv", daemon=True).start()
        return handle

    def is_completed(self) -> bool:
        """Whether the receive finished."""
        if self._work is not None:
            return bool(self._work.is_completed())
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the tensor and return the sender's global rank.

        Args:
            timeout: Seconds (default: the group's timeout).

        Raises:
            TimeoutError: If nothing arrived in time.
            RuntimeError: If the transport failed (e.g. the peer died).
        """
        limit = self._timeout if timeout is None else timeout
        if self._work is not None:
            try:
                self._work.wait(timeout=timedelta(seconds=limit))
            except RuntimeError as exc:
                if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                    raise TimeoutError(f"irecv from rank {self._src} timed out after {limit:g} s") from exc
                raise
            assert self._src is not None
            return self._src
        if not self._done.wait(limit):
            raise TimeoutError(f"irecv from any source timed out after {limit:g} s")
        if self._error is not None:
            raise self._error
        assert self._src is not None
        return self._src


class _ChainedWork:
    """An async handle that runs a finishing step (copy-out) after the underlying work completes."""

    def __init__(self, work: Any, finish: Callable[[], None]) -> None:
        self._work = work
        self._finish = finish
        self._finished = False

    def is_completed(self) -> bool:
        return self._finished or bool(self._work.is_completed())

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._finished:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout=timeout)
            self._finish()
            self._finished = True
        return True


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
            raise TypeError(f"{label} must be an int global rank, got {type(rank).__name__} {rank!r}")
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
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to global rank ``dst``."""
        dist.send(tensor, self._check_rank("dst", dst), group=self._pg(), tag=tag)

    def recv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> int:
        """Receive into ``tensor`` from ``src`` (None: any member); return the sender's global rank."""
        pg = self._pg()
        if src is not None:
            self._check_rank("src", src)
        return int(dist.recv(tensor, src=src, group=pg, tag=tag))

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Any:
        """Send ``tensor`` asynchronously; returns a request with ``wait()``."""
        return dist.isend(tensor, self._check_rank("dst", dst), group=self._pg(), tag=tag)

    def irecv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> RecvHandle:
        """Receive asynchronously; ``wait(timeout=None)`` on the result returns the sender's global rank.

        ``src=None`` receives from any member (gloo and MPI only).
        """
        pg = self._pg()
        if src is None:
            return RecvHandle.any_source(tensor, pg, tag, self.timeout)
        work = dist.irecv(tensor, src=self._check_rank("src", src), group=pg, tag=tag)
        return RecvHandle(src, work, self.timeout)

    # -- collectives ---
    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Any:
        """Broadcast ``tensor`` from global rank ``src`` to every member."""
        return dist.broadcast(tensor, self._check_rank("src", src), group=self._pg(), async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, op: Any = ReduceOp.SUM, async_op: bool = False) -> Any:
        """Reduce ``tensor`` in place across all members; every member gets the result."""
        return dist.all_reduce(tensor, op=op, group=self._pg(), async_op=async_op)

    def reduce(self, tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, async_op: bool = False) -> Any:
        """Reduce ``tensor`` onto global rank ``dst``."""
        return dist.reduce(tensor, self._check_rank("dst", dst), op=op, group=self._pg(), async_op=async_op)

    def all_gather(
        self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, async_op: bool = False
    ) -> Any:
        """Gather ``tensor`` from every member into ``tensor_list`` (ordered by group rank)."""
        return dist.all_gather(tensor_list, tensor, group=self._pg(), async_op=async_op)

    def gather(
        self,
        tensor: torch.Tensor,
        gather_list: list[torch.Tensor] | None = None,
        dst: int = 0,
        async_op: bool = False,
    ) -> Any:
        """Gather ``tensor`` from every member into ``gather_list`` on global rank ``dst``."""
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
        return dist.scatter(
            tensor, scatter_list, src=self._check_rank("src", src), group=self._pg(), async_op=async_op
        )

    def barrier(self, async_op: bool = False) -> Any:
        """Synchronise all members."""
        return dist.barrier(group=self._pg(), async_op=async_op)

    # -- per-process tensor lists (the removed *_multigpu functions) ---
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

        return _complete(dist.broadcast(head, src, group=pg, async_op=async_op), finish, async_op)

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

        return _complete(dist.reduce(head, dst, op=local_op, group=pg, async_op=async_op), finish, async_op)

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

        return _complete(dist.all_gather(gathered, stacked, group=pg, async_op=async_op), finish, async_op)

    def __reduce__(self) -> NoReturn:
        raise TypeError("CollectiveGroup wraps a process group of this process and cannot be pickled")

    def __repr__(self) -> str:
        return f"CollectiveGroup(ranks={self.ranks}, member={self.current_relative_rank >= 0})"


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
        return _ChainedWork(work, finish)
    finish()
    return None


def create_collective_group(
    world: World, ranks: Sequence[int], timeout: float, backend: str | None
) -> CollectiveGroup:
    """Check through the store that all world ranks entered with the same ``ranks``; call ``new_group``."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise TypeError(f"ranks must be a sequence of ints, got {type(ranks).__name__} {ranks!r}")
    members = sorted(ranks)
    if not members or len(set(members)) != len(members):
        raise ValueError(f"ranks must be non-empty and unique, got {list(ranks)}")
    for r in members:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world.world_size:
            raise ValueError(f"ranks must be ints in [0, {world.world_size}), got {list(ranks)}")
    seq = world._cg_seq
    world._cg_seq += 1
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
    pg = dist.new_group(members, timeout=timedelta(seconds=timeout), backend=backend)
    relative = members.index(world.rank) if world.rank in members else -1
    group = CollectiveGroup(pg, relative, members, timeout)
    world.collective_groups.append(group)
    return group
