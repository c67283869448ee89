"""The engines that carry an elastic step's collectives: gloo groups (any device) or NCCL groups (CUDA).

Each quorum gets a group of its own (:meth:`group`); the trainer reduces and broadcasts through the engine and
hands a group back (:meth:`drop`) when its quorum is over or broken, never waiting on it again.

- :class:`GlooEngine` (the default): gloo groups carry host tensors; a CUDA module's sums and state are staged
  through host memory. A collective is bounded by gloo's own timeout, and a broken group is simply dropped.
- :class:`NcclEngine`: NCCL groups carry the sums on the device. NCCL gives no bound of its own that leaves
  the process alive (its watchdog ends the process), and a communicator's set-up waits inside NCCL for every
  peer. So each collective (and the set-up, which torch runs at the group's first collective) runs on a helper
  thread while the caller waits at most ``timeout``; past it, or on an error, the collective raises, the
  trainer drops the group, and dropping an NCCL group aborts it (``ncclCommAbort``, which ends the kernels and
  the set-up waiting for a dead peer, and so the helper's wait): the step fails like a gloo step whose peer
  died. Every dropped group is aborted, not destroyed: a communicator holds device memory, and the graceful
  destroy would wait for peers that may be gone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pc_distributed import _torch_dist
from pc_distributed._bounded import call_bounded

__all__ = ["ENGINES", "GlooEngine", "NcclEngine", "engine_for"]

# The device types whose tensors an NCCL group carries.
NCCL_DEVICE_TYPES: tuple[str, ...] = ("cuda",)


class GlooEngine:
    """Quorum groups on gloo: host tensors, gloo's timeout, a broken group dropped."""

    name = "gloo"

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout

    def group(self, store: Any, prefix: str, rank: int, size: int) -> Any:
        """A new group for one quorum. Raises ``RuntimeError`` if a member does not arrive in time."""
        return _torch_dist.quorum_group(store, prefix, rank, size, self.timeout)

    def all_reduce_sum(self, group: Any, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place over ``group`` (through host memory if it is on a device)."""
        on_host = tensor if tensor.device.type == "cpu" else tensor.cpu()
        _torch_dist.group_all_reduce_sum(group, on_host, self.timeout)
        if on_host is not tensor:
            tensor.copy_(on_host)

    def broadcast(self, group: Any, tensor: torch.Tensor, root: int) -> None:
        """Broadcast the host tensor ``tensor`` in place from group rank ``root``."""
        _torch_dist.group_broadcast(group, tensor, root, self.timeout)

    def drop(self, group: Any) -> None:
        """Let ``group`` go: nothing to do for gloo (its connections close with it)."""


class NcclEngine:
    """Quorum groups on NCCL: device tensors, each collective bounded by a helper thread and an abort.

    Args:
        timeout: Seconds each collective (the group's set-up included) may take before the group is aborted.
        device: The CUDA device of the module (each member its own GPU: NCCL refuses two members on one).
    """

    name = "nccl"

    def __init__(self, timeout: float, device: torch.device) -> None:
        self.timeout = timeout
        self.device = device

    def group(self, store: Any, prefix: str, rank: int, size: int) -> Any:
        """A new group for one quorum; its communicator is made at its first collective."""
        return _torch_dist.nccl_quorum_group(store, prefix, rank, size, self.timeout)

    def all_reduce_sum(self, group: Any, tensor: torch.Tensor) -> None:
        """Sum the device tensor ``tensor`` in place over ``group``, or raise.

        Raises:
            RuntimeError: If the collective failed or did not finish within the timeout; the caller then
                drops the group (:meth:`drop` aborts it, which also ends the helper thread's wait).
        """
        self._bounded(tensor, lambda: group.allreduce([tensor]), "all-reduce")

    def broadcast(self, group: Any, tensor: torch.Tensor, root: int) -> None:
        """Broadcast the host tensor ``tensor`` in place from ``root``, through the device."""
        on_device = tensor.to(self.device)
        options = torch.distributed.BroadcastOptions()
        options.rootRank = root
        self._bounded(on_device, lambda: group.broadcast([on_device], options), "broadcast")
        tensor.copy_(on_device)

    def drop(self, group: Any) -> None:
        """Abort ``group`` (never the graceful destroy, which waits for its peers)."""
        _torch_dist.abort_group(group)

    def _bounded(self, tensor: torch.Tensor, launch: Callable[[], Any], what: str) -> None:
        """Run ``launch`` and wait for its result on a helper thread, at most the timeout, else raise."""
        on_cuda = tensor.device.type == "cuda"
        ready = None
        if on_cuda:  # the caller's stream produced the tensor: the helper's stream waits for it
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record()

        def run() -> None:
            if ready is None:
                launch().wait()
                return
            torch.cuda.set_device(tensor.device)
            torch.cuda.current_stream().wait_event(ready)
            work = launch()
            work.wait()  # the helper's stream waits for NCCL's
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record()
            done.synchronize()  # the host wakes when the sum is complete (or the abort ends the kernel)

        try:
            call_bounded(run, self.timeout, f"NCCL {what} of an elastic step")
        except TimeoutError as exc:  # the helper stays blocked until the caller drops (aborts) the group
            raise RuntimeError(str(exc)) from exc


ENGINES = ("gloo", "nccl")


def engine_for(dist_backend: str | None, device: torch.device, timeout: float) -> GlooEngine | NcclEngine:
    """The engine named ``dist_backend`` (None: gloo) for a module on ``device``.

    Raises:
        TypeError: If ``dist_backend`` is not a string or None.
        ValueError: An unknown name, or NCCL for a module not on a CUDA device.
        RuntimeError: If this torch build lacks the engine (no gloo; no abortable NCCL groups).
    """
    if dist_backend is not None and not isinstance(dist_backend, str):
        raise TypeError(f"dist_backend must be a string or None, got {type(dist_backend).__name__}")
    name = "gloo" if dist_backend is None else dist_backend.lower()
    if name not in ENGINES:
        raise ValueError(f"dist_backend must be one of {ENGINES} (or None: gloo), got {dist_backend!r}")
    if name == "gloo":
        if not _torch_dist.elastic_groups_available():
            raise RuntimeError("this torch build has no gloo, which ElasticDataParallel's groups need")
        return GlooEngine(timeout)
    if device.type not in NCCL_DEVICE_TYPES:
        raise ValueError(f"dist_backend='nccl' needs a module on a CUDA device, got one on {device}")
    if not _torch_dist.nccl_quorum_groups_available():
        raise RuntimeError(
            "dist_backend='nccl': this torch build has no abortable NCCL groups (NCCL, its non-blocking "
            "communicator config and an abort); use dist_backend='gloo'"
        )
    return NcclEngine(timeout, device)
