"""Helpers shared by the pc-sync tests: reference pairs and step-by-step comparisons."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import pc_sync
from pc_replicate import ReplicationCallbackDataParallel
from pc_sync._torch_bn import FUSED_OPS, ReferenceKernels
from pc_sync.replica_batchnorm import _TORCH_BN_TAKES_BIAS

SYNC_OF = {
    nn.BatchNorm1d: pc_sync.SynchronizedBatchNorm1d,
    nn.BatchNorm2d: pc_sync.SynchronizedBatchNorm2d,
    nn.BatchNorm3d: pc_sync.SynchronizedBatchNorm3d,
}


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}


def randomize(module: nn.Module, gen: torch.Generator) -> None:
    """Random affine parameters and running statistics, so nothing passes because gamma=1/beta=0."""
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if t.is_floating_point():
                values = torch.rand(t.shape, generator=gen, dtype=t.dtype) + 0.5
                if "var" not in name:
                    values = torch.randn(t.shape, generator=gen, dtype=t.dtype)
                t.copy_(values)


def reference_bn(ref_cls: type[nn.Module], num_features: int, dtype: torch.dtype, **kwargs: Any) -> nn.Module:
    """torch's batch norm with ``kwargs``; ``bias=False`` also on a torch whose layer does not take it."""
    ref_kwargs = dict(kwargs)
    drop_bias = not _TORCH_BN_TAKES_BIAS and ref_kwargs.pop("bias", True) is False
    ref = ref_cls(num_features, dtype=dtype, **ref_kwargs)
    if drop_bias:  # torch before the ``bias`` switch (2.11): a bias-free reference by hand
        ref.register_parameter("bias", None)
    return ref


def bn_pair(
    ref_cls: type[nn.Module], num_features: int, dtype: torch.dtype, seed: int = 0, **kwargs: Any
) -> tuple[nn.Module, nn.Module]:
    """A torch batch norm with random state and its synchronized twin with the same state."""
    gen = torch.Generator().manual_seed(seed)
    ref = reference_bn(ref_cls, num_features, dtype, **kwargs)
    randomize(ref, gen)
    ours = SYNC_OF[ref_cls](num_features, dtype=dtype, **kwargs)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def replicated(module: nn.Module, n: int) -> nn.Module:
    return ReplicationCallbackDataParallel(module, device_ids=["cpu"] * n)


def compare_steps(
    ref: nn.Module,
    ours: nn.Module,
    shape: tuple[int, ...],
    n: int,
    dtype: torch.dtype,
    *,
    steps: int = 3,
    seed: int = 1,
    layout: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    offset: float = 0.0,
) -> None:
    """Train ``steps`` steps on random data with a random upstream gradient, then one eval step.

    ``ref`` runs on the full batch in one thread; ``ours`` runs on ``n`` CPU thread replicas. Outputs, input
    gradients, parameter gradients, buffers and ``num_batches_tracked`` must match after every step.
    ``offset`` shifts the data away from zero.
    """
    gen = torch.Generator().manual_seed(seed)
    dp = replicated(ours, n)
    tol = tolerances(dtype)
    for step in range(steps + 1):
        training = step < steps
        ref.train(training)
        dp.train(training)
        x = torch.randn(shape, generator=gen, dtype=dtype) * 2 + offset
        xa = layout(x.clone()).requires_grad_()
        xb = layout(x.clone()).requires_grad_()
        if not training and getattr(ref, "running_mean", None) is None:
            # eval without running stats: batch statistics of each replica's chunk, no sync (as torch's BN
            # under DataParallel and nn.SyncBatchNorm)
            ya = torch.cat([ref(chunk) for chunk in xa.chunk(n)])
        else:
            ya = ref(xa)
        yb = dp(xb)
        g = torch.randn(ya.shape, generator=gen, dtype=dtype)
        assert_close(yb, ya, **tol, msg=f"output, step {step}")
        (ya * g).sum().backward()
        (yb * g).sum().backward()
        assert xa.grad is not None
        assert xb.grad is not None
        assert_close(xb.grad, xa.grad, **tol, msg=f"input grad, step {step}")
        for (name, pa), (_, pb) in zip(ref.named_parameters(), ours.named_parameters(), strict=True):
            assert pa.grad is not None
            assert pb.grad is not None
            assert_close(pb.grad, pa.grad, **tol, msg=f"{name}.grad, step {step}")
            pa.grad, pb.grad = None, None
        for (name, ba), (_, bb) in zip(ref.named_buffers(), ours.named_buffers(), strict=True):
            assert_close(bb, ba, **tol, msg=f"buffer {name}, step {step}")


def ddp_sync_bn_worker(rank: int, world: int, tmp: str, x: torch.Tensor, g: torch.Tensor) -> None:
    """One rank of ``torch.nn.SyncBatchNorm`` over NCCL (spawned by the gpu tests); results go to ``tmp``."""
    import os

    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"file://{os.path.join(tmp, 'store')}", rank=rank, world_size=world
    )
    try:
        bn = nn.SyncBatchNorm(x.shape[1]).cuda(rank)
        xs = x.chunk(world)[rank].cuda(rank).requires_grad_()
        y = bn(xs)
        (y * g.chunk(world)[rank].cuda(rank)).sum().backward()
        assert xs.grad is not None
        assert bn.weight.grad is not None
        result = {
            "y": y.detach().cpu(),
            "xgrad": xs.grad.cpu(),
            "wgrad": bn.weight.grad.cpu(),  # local: no DDP averaging, summed by the caller
            "running_var": bn.running_var.cpu(),
        }
        torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float, msg: str = ""
) -> None:
    """Like ``torch.testing.assert_close`` (shape, dtype, device, values), without its heavy lazy imports."""
    assert actual.shape == expected.shape, f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{msg}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.device == expected.device, f"{msg}: device {actual.device} != {expected.device}"
    if not actual.is_floating_point():
        assert torch.equal(actual, expected), f"{msg}: {actual} != {expected}"
        return
    diff = (actual.detach() - expected.detach()).abs()
    bound = atol + rtol * expected.detach().abs()
    bad = ~(diff <= bound)
    assert not bool(bad.any()), (
        f"{msg}: {int(bad.sum())}/{diff.numel()} elements differ, max abs diff {diff.max().item():.3g} "
        f"(rtol={rtol}, atol={atol})"
    )


class CountingKernels(ReferenceKernels):
    """The stand-in kernels, counting their calls by name (so a test knows the fused path ran)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        if name in FUSED_OPS:
            calls = super().__getattribute__("calls")

            def counted(*args: Any, **kwargs: Any) -> Any:
                calls[name] += 1
                return attr(*args, **kwargs)

            return counted
        return attr
