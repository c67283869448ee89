"""The launch budget: the ops one synchronized layer issues per replica per training step, counted on CPU.

On a GPU each op of the layer is at least one kernel launch, and a step of small layers is bound by launches,
not arithmetic. GPUs are rarely available here, so the CUDA path's orchestration is counted on CPU: the fused
path runs on the stand-ins of torch's five batch-norm kernels (``pc_sync._torch_bn.REFERENCE_KERNELS``), each
call of which counts as one op (it is one operator, one or two launches, on CUDA) while the ops inside it are
not counted; every other op the layer dispatches is counted by a ``TorchDispatchMode``:

- counted: every operator that computes or copies, ``torch.tensor`` constants included (``lift_fresh``: an
  upload on CUDA), the ``add`` that autograd issues to sum the replicas' contributions, and the parameters'
  gradient accumulation;
- not counted: views and metadata (``is_view`` operators: ``view``, ``select``, ``unbind``, ...), and bare
  allocations (``empty*``, ``detach``), which launch nothing.

The scope is the layer alone: forward inside the layer's own call in each replica thread, backward from the
replicas' outputs to their inputs (each replica's input a leaf of its own, so neither the scatter nor the
gather of the data-parallel wrapper nor the loss is counted). Plain ``nn.BatchNorm2d`` on the same replicas,
counted the same way, is the baseline: its forward and backward are two fused operators per replica.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pc_replicate import ReplicationCallbackDataParallel
from pc_sync import SynchronizedBatchNorm2d
from pc_sync._torch_bn import FUSED_OPS, ReferenceKernels

__all__ = ["Tally", "count_layer_ops"]

_SILENT = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias"}


class Tally:
    """Ops counted by name, from any thread; a thread inside a stand-in kernel is not counted."""

    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._inside = threading.local()

    def note(self, name: str) -> None:
        if getattr(self._inside, "depth", 0):
            return
        with self._lock:
            self.ops[name] += 1

    @contextmanager
    def kernel(self, name: str) -> Iterator[None]:
        self.note(f"kernel {name}")
        self._inside.depth = getattr(self._inside, "depth", 0) + 1
        try:
            yield
        finally:
            self._inside.depth -= 1

    def total(self) -> int:
        return sum(self.ops.values())


class _Counting(TorchDispatchMode):
    def __init__(self, tally: Tally) -> None:
        super().__init__()
        self.tally = tally

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        packet = func.overloadpacket.__name__
        if not func.is_view and packet not in _SILENT:
            self.tally.note(packet)
        return func(*args, **(kwargs or {}))


class _CountedKernels(ReferenceKernels):
    """The stand-ins, each call one op of the tally."""

    def __init__(self, tally: Tally) -> None:
        self.tally = tally

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        if name not in FUSED_OPS:
            return attr
        tally = super().__getattribute__("tally")

        def counted(*args: Any, **kwargs: Any) -> Any:
            with tally.kernel(name):
                return attr(*args, **kwargs)

        return counted


class _Scoped(nn.Module):
    """Counts the wrapped layer's forward in whichever thread runs it."""

    def __init__(self, layer: nn.Module, tally: Tally) -> None:
        super().__init__()
        self.layer = layer
        self.tally = tally
        self.counting = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.counting:
            return self.layer(x)  # type: ignore[no-any-return]
        with _Counting(self.tally):
            return self.layer(x)  # type: ignore[no-any-return]


def count_layer_ops(kind: str, replicas: int, shape: tuple[int, ...] = (16, 8, 4, 4)) -> Counter[str]:
    """The ops one training step of one layer issues on ``replicas`` CPU thread replicas, summed over them.

    Args:
        kind: ``"plain"`` (``nn.BatchNorm2d``), ``"composite"`` (SyncBN on CPU as it runs there) or
            ``"fused"`` (SyncBN on the stand-ins: the orchestration of the CUDA path).
        replicas: Thread replicas.
        shape: The batch.
    """
    tally = Tally()
    channels = shape[1]
    layer: nn.Module = nn.BatchNorm2d(channels) if kind == "plain" else SynchronizedBatchNorm2d(channels)
    if kind == "fused":
        layer._bn_kernels = _CountedKernels(tally)  # type: ignore[assignment]
    scoped = _Scoped(layer, tally)
    dp = ReplicationCallbackDataParallel(scoped, device_ids=["cpu"] * replicas)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):  # two warm-up steps (constants cached as in a training loop), then the counted one
        counting = step == 2
        tally.ops.clear()
        x = torch.randn(shape, generator=gen)
        inputs = [chunk.detach().requires_grad_() for chunk in x.chunk(replicas)]
        copies = dp.replicate(scoped, dp.device_ids[: len(inputs)])
        for copy in copies:
            copy.counting = counting
        outputs = dp.parallel_apply(copies, [(t,) for t in inputs], [{} for _ in inputs])
        grads = [torch.randn(o.shape, generator=gen) for o in outputs]
        if counting:
            with _Counting(tally):
                torch.autograd.backward(outputs, grads)
        else:
            torch.autograd.backward(outputs, grads)
        for p in layer.parameters():
            p.grad = None
    return tally.ops


def count_process_ops(rank: int, kind: str, shape: tuple[int, ...] = (8, 8, 4, 4)) -> dict[str, int]:
    """One rank's ops for one training step of a ``SyncBatchNorm`` without replicas (the DDP case).

    Run on every rank of a process group (``pc_distributed.run_world``). ``kind`` is ``"composite"`` or
    ``"fused"`` (the stand-ins). Collectives are counted where ``torch.distributed`` is called (one op each,
    its ``stack``/``sum`` of the gathered packets counted by the dispatch mode like any op), since the
    dispatch mode does not see inside them.
    """
    import torch.distributed as dist

    from pc_sync import SyncBatchNorm

    torch.set_num_threads(1)
    tally = Tally()
    layer = SyncBatchNorm(shape[1])
    if kind == "fused":
        layer._bn_kernels = _CountedKernels(tally)  # type: ignore[assignment]
    gen = torch.Generator().manual_seed(rank)
    originals = {name: getattr(dist, name) for name in ("all_gather", "all_reduce")}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            tally.note(f"collective {name}")
            with tally.kernel("(inside a collective)"):
                return originals[name](*args, **kwargs)

        return call

    for step in range(3):  # two warm-up steps (the group's packets widened, constants cached), one counted
        x = torch.randn(shape, generator=gen).requires_grad_()
        g = torch.randn(shape, generator=gen)
        tally.ops.clear()
        if step < 2:
            (layer(x) * g).sum().backward()
            continue
        for name in originals:
            setattr(dist, name, counted(name))
        try:
            with _Counting(tally):
                y = layer(x)
            z = y * g
            with _Counting(tally):
                torch.autograd.backward([y], [g])
            del z
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
    ops = dict(tally.ops)
    ops.pop("kernel (inside a collective)", None)
    return ops


if __name__ == "__main__":
    for kind in ("plain", "composite", "fused"):
        for n in (2, 4):
            ops = count_layer_ops(kind, n)
            per_replica = sum(ops.values()) / n
            print(f"{kind:9} {n} replicas: {per_replica:5.1f} per replica  {dict(sorted(ops.items()))}")
