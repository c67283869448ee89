"""pc-sync benchmark: a training step of a small CNN under DDP with gloo on CPU, 2 ranks.

Three variants of the same model, measured side by side in one local world (``pc_distributed.run_world``),
round by round in alternating order (``interleaved_samples``), every rank running the same sequence:

1. ``nn.BatchNorm2d`` -- the cost of not synchronizing (the baseline of the issue's target);
2. ``pc_sync.SyncBatchNorm`` (``convert_sync_batchnorm``): one ``all_gather`` in forward and one
   ``all_reduce`` in backward per layer, one autograd node per layer with a hand-written backward;
3. a naive synchronized batch norm written here: ``all_reduce`` of per-channel sums and sums of squares
   through a differentiable ``all_reduce`` (its backward all-reduces the gradient), the rest composite ops;

and, in a world of its own, the ops one ``SyncBatchNorm`` layer issues per process per training step without
replicas (``op_count.count_process_ops``): the composite CPU path and the CUDA path's fused kernels (their
stand-ins), the two collectives included.

Each rank runs one intra-op thread. Every variant first runs three warm-up steps (DDP rebuilds its gradient
buckets after the first). Times are wall time per step on rank 0, the median over interleaved rounds of two
steps each: the step includes the collectives, whose waiting is not CPU time. Every collective is a point
where both ranks must be running, so on a machine whose cores other processes share the synchronized
variants lose more to the load than plain batch norm (one gradient all-reduce per step); the run records the
load average beside the figures.

Run: ``python packages/pc-sync/benchmarks/run_processes.py [--quick] [--out results.json]``.
"""

from __future__ import annotations

import os
import pathlib
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
from benchlib import Report, bench_args, interleaved_samples
from op_count import count_process_ops

import pc_distributed
import pc_sync

RANKS = 2


class _AllReduce(torch.autograd.Function):
    """``all_reduce(SUM)`` whose gradient is the all-reduced gradient (each rank's loss uses the sum)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone()
        dist.all_reduce(out)
        return out


class NaiveSyncBatchNorm2d(nn.BatchNorm2d):
    """The textbook synchronized batch norm: all-reduced sums and sums of squares, composite autograd."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(input)
        dims = [0, 2, 3]
        count = torch.full((1,), input.numel() / input.size(1), dtype=input.dtype)
        packed = torch.cat([input.sum(dims), input.square().sum(dims), count])
        packed = _AllReduce.apply(packed)
        channels = input.size(1)
        total = packed[-1]
        mean = packed[:channels] / total
        var = packed[channels : 2 * channels] / total - mean.square()
        if self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                unbiased = var * (total / (total - 1))
                self.running_mean.lerp_(mean, self.momentum or 0.1)
                self.running_var.lerp_(unbiased, self.momentum or 0.1)
        shape = [1, channels, 1, 1]
        scale = torch.rsqrt(var + self.eps) * self.weight
        return (input - mean.reshape(shape)) * scale.reshape(shape) + self.bias.reshape(shape)


def small_cnn(norm: Callable[[int], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        norm(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        norm(32),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        norm(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def _rank(rank: int, batch: int, repeat: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    variants = {
        "plain": small_cnn(nn.BatchNorm2d),
        "pc": pc_sync.convert_sync_batchnorm(small_cnn(nn.BatchNorm2d)),
        "naive": small_cnn(NaiveSyncBatchNorm2d),
    }
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, 3, 32, 32, generator=gen)
    target = torch.randint(0, 10, (batch,), generator=gen)
    steps: dict[str, Callable[[], None]] = {}
    for name, model in variants.items():
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

        def step(ddp: nn.Module = ddp, opt: torch.optim.Optimizer = opt) -> None:
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), target).backward()
            opt.step()

        steps[name] = step
    samples = interleaved_samples(steps, repeat, number=2, warmup=3)
    dist.barrier()
    return samples


def main() -> None:
    args = bench_args("pc-sync processes")
    report = Report("pc-sync")
    batch, repeat = (16, 5) if args.quick else (32, 40)
    # A torch optimizer's first construction imports torch._dynamo; forked ranks inherit it from here.
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    load_before = os.getloadavg()[0]
    results = pc_distributed.run_world(
        _rank, RANKS, args=(batch, repeat), start_method="fork", init_rpc=False, timeout=600
    )
    load_after = os.getloadavg()[0]
    samples = results[0]
    best = {name: statistics.median(s) for name, s in samples.items()}
    fastest = {name: min(s) for name, s in samples.items()}
    case = f"DDP gloo CPU step, {RANKS} ranks x {batch}x3x32x32, 3 BN"
    report.row(case, "SyncBatchNorm (pc-sync)", best["pc"])
    report.row(case, "naive all_reduce SyncBN", best["naive"])
    report.row(case, "BatchNorm2d (no sync)", best["plain"], baseline=True)
    ratio = best["pc"] / best["plain"]
    report.target(
        f"(issue 30) CPU DDP step, SyncBatchNorm / plain BN, {RANKS} ranks",
        ratio,
        "<=",
        1.3,
        note=""
        if ratio <= 1.3
        else (
            "the synchronized step adds one all_gather per layer in forward and one all_reduce per layer in "
            "backward, each a blocking gloo round trip between the ranks and a point where both ranks must "
            f"be running at once: at a load average of {max(load_before, load_after):.1f} on "
            f"{os.cpu_count()} CPUs a rank waits for its peer to be scheduled again (the rounds' minima: "
            f"{fastest['pc'] / fastest['plain']:.3f}x)"
        ),
    )
    case = f"ops per process per training step, {RANKS} ranks, no replicas"
    for kind, label in (("composite", "composite path (CPU)"), ("fused", "fused path (CUDA's, stand-ins)")):
        ops = pc_distributed.run_world(
            count_process_ops, RANKS, args=(kind,), start_method="fork", init_rpc=False, timeout=300
        )[0]
        report.row(
            case, f"SyncBatchNorm, {label}", float(sum(ops.values())), "ops", baseline=kind == "composite"
        )
    report.note(
        "ops per process: one layer's training step on rank 0, each collective one op, views and bare "
        "allocations not counted, the fused kernels' stand-ins one op per call; on CUDA the forward also "
        "copies the gathered headers to the host once (a copy the CPU run does not dispatch)"
    )
    report.note(
        f"process-group SyncBatchNorm rows: wall time per step on rank 0, median of {repeat} interleaved "
        f"rounds of 2 steps after 3 warm-up steps, one intra-op thread per rank, {os.cpu_count()} CPUs, load "
        f"average {load_before:.1f} before and {load_after:.1f} after the run; the same rounds' minima give "
        f"SyncBatchNorm / plain BN {fastest['pc'] / fastest['plain']:.3f}x and naive / plain BN "
        f"{fastest['naive'] / fastest['plain']:.3f}x; torch.nn.SyncBatchNorm refuses CPU tensors, so it has "
        "no CPU row"
    )
    report.finish(args)


if __name__ == "__main__":
    main()
