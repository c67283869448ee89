"""Rank functions for ranks that reach one SyncBatchNorm exchange by different paths (under ``run_world``).

A path is how a process runs the layer: without a wrapper, under ``ReplicationCallbackDataParallel`` on one
replica (a batch of one row), on several, or with an empty batch. Each pairing trains against torch's batch
norm on the full batch (``sync_world_workers.compare_layer``); each mismatch (channels, dtype) must give a
``ValueError`` on every rank, after which the group still works.
"""

from __future__ import annotations

from typing import Any

import torch
from sync_world_workers import compare_layer, layer_cases

import pc_sync

# rank 0's and rank 1's (replicas of the wrapper, 0 = no wrapper; rows of the global batch)
PAIRINGS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "one_replica_and_two": ((2, 1), (2, 6)),
    "no_wrapper_and_two_replicas": ((0, 3), (2, 6)),
    "no_wrapper_and_one_replica": ((0, 4), (2, 1)),
    "empty_without_wrapper_and_two_replicas": ((0, 0), (2, 6)),
    "empty_under_wrapper_and_two_replicas": ((2, 0), (2, 5)),
    "two_replicas_and_three": ((2, 4), (3, 7)),
}


def pairings_world(rank: int) -> dict[str, Any]:
    """Every pairing of paths, on 2-D and 4-D batches (uneven rows, random weights, buffers and gradients)."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for i, (name, paths) in enumerate(PAIRINGS.items()):
        replicas = [paths[0][0], paths[1][0]]
        sizes = [paths[0][1], paths[1][1]]
        n = sum(sizes)
        out[name] = {
            "4d": compare_layer(rank, sizes, (n, 3, 2, 3), seed=200 + i, replicas=replicas),
            "2d": compare_layer(rank, sizes, (n, 5), seed=300 + i, replicas=replicas, momentum=None),
        }
    return out


def _call(bn: torch.nn.Module, x: torch.Tensor, replicas: int) -> str:
    """Run one training step of ``bn`` (under ``replicas`` thread replicas if > 0); the error it raised."""
    from pc_replicate import ReplicationCallbackDataParallel

    model = ReplicationCallbackDataParallel(bn, device_ids=["cpu"] * replicas) if replicas else bn
    try:
        model(x.requires_grad_(True)).sum().backward()
    except ValueError as exc:
        return f"ValueError: {exc}"
    return "no error"


def mismatch_world(rank: int) -> dict[str, Any]:
    """Ranks whose layers differ, in a group whose packets are narrower or already wider than either layer."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    # the group's first exchanges: rank 1's layer is wider than any packet the group has sent so far
    out["channels_3_and_4"] = _call(pc_sync.SyncBatchNorm(3 + rank), torch.randn(4, 3 + rank), 0)
    out["channels_3_and_400"] = _call(
        pc_sync.SyncBatchNorm(3 + 397 * rank), torch.randn(4, 3 + 397 * rank, 2), 0
    )
    # a matching layer widens the group to 8 channels; the next mismatches fit in its packets on both ranks
    out["matching_8"] = _call(pc_sync.SyncBatchNorm(8), torch.randn(4, 8), 0)
    out["channels_5_and_6_replicas"] = _call(
        pc_sync.SyncBatchNorm(5 + rank), torch.randn(6, 5 + rank), 2 * rank
    )
    out["channels_6_and_12"] = _call(pc_sync.SyncBatchNorm(6 + 6 * rank), torch.randn(4, 6 + 6 * rank), 0)
    dtype = torch.float64 if rank else torch.float32
    out["dtypes"] = _call(pc_sync.SyncBatchNorm(3, dtype=dtype), torch.randn(4, 3, dtype=dtype), 0)
    out["dtypes_replicas"] = _call(
        pc_sync.SyncBatchNorm(3, dtype=dtype), torch.randn(4, 3, dtype=dtype), 2 * (1 - rank)
    )
    # the group still works, and still matches torch: an uneven batch through two paths
    out["after"] = compare_layer(rank, [2, 5], (7, 3, 2), seed=400, replicas=[0, 2])
    return out


def fused_pairings_world(rank: int) -> dict[str, Any]:
    """Every pairing on the fused kernels' stand-ins; and ranks on different paths of computation (one on the
    fused kernels, the other on the composite float64 path), which send the same packets.
    """
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for i, (name, paths) in enumerate(PAIRINGS.items()):
        replicas = [paths[0][0], paths[1][0]]
        sizes = [paths[0][1], paths[1][1]]
        n = sum(sizes)
        out[name] = compare_layer(rank, sizes, (n, 3, 2, 3), seed=500 + i, replicas=replicas, fused=True)
        out[f"{name}_mixed"] = compare_layer(
            rank, sizes, (n, 4), seed=600 + i, replicas=replicas, fused=[i % 2 == 0, i % 2 == 1]
        )
    return out


def fused_grid_world(rank: int) -> dict[str, Any]:
    """Four ranks on the fused stand-ins, uneven batches with an empty rank: every input rank and option."""
    torch.set_num_threads(1)
    sizes = [3, 0, 5, 2]
    n = sum(sizes)
    cases = {**layer_cases(n), "bias_false": ((n, 3, 4), {"bias": False})}
    out: dict[str, Any] = {}
    for i, (name, (shape, kwargs)) in enumerate(cases.items()):
        out[name] = compare_layer(rank, sizes, shape, seed=700 + i, fused=True, **kwargs)
    out["replicas"] = compare_layer(rank, [4, 6, 5, 3], (18, 3, 2, 3), seed=710, replicas=2, fused=True)
    out["float16"] = _float16(rank, sizes)
    return out


def _float16(rank: int, sizes: list[int]) -> dict[str, float]:
    """An fp16 input to an fp32 layer on the fused stand-ins: fp16 output, fp32 statistics of all ranks."""
    from sync_testutils import CountingKernels
    from sync_world_workers import _max_diff

    gen = torch.Generator().manual_seed(720)
    x = (torch.randn(sum(sizes), 3, 4, 4, generator=gen) * 2 + 10).half()
    ours = pc_sync.SyncBatchNorm(3)
    kernels = CountingKernels()
    ours._bn_kernels = kernels
    ref = torch.nn.BatchNorm2d(3, dtype=torch.float64)
    lo = sum(sizes[:rank])
    hi = lo + sizes[rank]
    xa = x[lo:hi].clone().requires_grad_(True)
    y = ours(xa)
    y.float().sum().backward()
    y_ref = ref(x.double())
    return {
        "output_is_fp16": 0.0 if y.dtype == torch.float16 else 1.0,
        "grad_is_fp16": 0.0 if xa.grad is not None and xa.grad.dtype == torch.float16 else 1.0,
        "stats_are_fp32": 0.0 if ours.running_mean.dtype == torch.float32 else 1.0,  # type: ignore[union-attr]
        "running_mean": _max_diff(ours.running_mean, ref.running_mean),
        "running_var": _max_diff(ours.running_var, ref.running_var) / float(ref.running_var.abs().max()),  # type: ignore[union-attr]
        "output": _max_diff(y, y_ref[lo:hi]),
        "gather_calls": float(kernels.calls["batch_norm_gather_stats_with_counts"]),
    }
