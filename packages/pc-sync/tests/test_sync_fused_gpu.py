"""The fused CUDA path on real kernels: torch's five operators against their stand-ins, and the layer on them.

Every test carries the ``gpu`` marker (skipped without CUDA). The stand-ins (``pc_sync._torch_bn``) are what
the CPU tests drive the orchestration with; here they are checked against the operators they stand for, on
the same CUDA inputs, in every dtype combination the layer sends them; then the replicas (two on one GPU) and
two ranks sharing the GPU over gloo run on the operators themselves against torch on the full batch.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from sync_testutils import assert_close, bn_pair
from sync_world_workers import shared_gpu_fused_world
from torch import nn

from pc_replicate import patch_replication_callback
from pc_sync import _torch_bn
from pc_sync._torch_bn import FUSED_OPS, REFERENCE_KERNELS, TORCH_KERNELS, TorchKernels, kernels_for

pytestmark = pytest.mark.gpu

pd = pytest.importorskip("pc_distributed")

# (input dtype, parameter and running-statistics dtype, memory format)
COMBINATIONS = [
    (torch.float32, torch.float32, torch.contiguous_format),
    (torch.float64, torch.float64, torch.contiguous_format),
    (torch.float16, torch.float32, torch.contiguous_format),  # autocast: fp16 input, fp32 layer
    (torch.float16, torch.float16, torch.contiguous_format),  # model.half()
    (torch.bfloat16, torch.float32, torch.contiguous_format),
    (torch.float32, torch.float32, torch.channels_last),
]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {
        torch.float64: {"rtol": 1e-10, "atol": 1e-10},
        torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    }.get(dtype, {"rtol": 2e-2, "atol": 2e-2})


class _CountingTorch(TorchKernels):
    """torch's operators, counting their calls (so a test knows the layer ran on them)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        if name not in FUSED_OPS:
            return attr
        calls = super().__getattribute__("calls")

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return attr(*args, **kwargs)

        return counted


@pytest.mark.parametrize(("dtype", "pdtype", "fmt"), COMBINATIONS, ids=str)
def test_stand_ins_compute_what_the_operators_compute(
    dtype: torch.dtype, pdtype: torch.dtype, fmt: torch.memory_format
) -> None:
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda", 0)
    parts = [
        (torch.randn(n, 4, 5, 3, generator=gen, dtype=torch.float64) * 2 + 3)
        .to(dev, dtype)
        .contiguous(memory_format=fmt)
        for n in (3, 5)
    ]
    w = (torch.rand(4, generator=gen, dtype=torch.float64) + 0.5).to(dev, pdtype)
    b = torch.randn(4, generator=gen, dtype=torch.float64).to(dev, pdtype)
    dy = (
        torch.randn(parts[0].shape, generator=gen, dtype=torch.float64)
        .to(dev, dtype)
        .contiguous(memory_format=fmt)
    )
    tol = _tol(dtype)
    out: dict[str, list[Any]] = {}
    for kernels in (TORCH_KERNELS, REFERENCE_KERNELS):
        running = (torch.zeros(4, device=dev, dtype=pdtype), torch.ones(4, device=dev, dtype=pdtype))
        stats = [kernels.batch_norm_stats(p, 1e-5) for p in parts]
        counts = torch.tensor([p.numel() // 4 for p in parts], device=dev, dtype=pdtype)
        mean, invstd = kernels.batch_norm_gather_stats_with_counts(
            parts[0],
            torch.stack([m for m, _ in stats]),
            torch.stack([i for _, i in stats]),
            *running,
            0.3,
            1e-5,
            counts,
        )
        y = kernels.batch_norm_elemt(parts[0], w, b, mean, invstd, 1e-5)
        sum_dy, sum_dy_xmu, gw, gb = kernels.batch_norm_backward_reduce(
            dy, parts[0], mean, invstd, w, True, True, True
        )
        assert sum_dy is not None
        assert sum_dy_xmu is not None
        count = torch.tensor([p.numel() // 4 for p in parts], device=dev, dtype=torch.int32)
        w_elemt = w.to(mean.dtype)
        dx = kernels.batch_norm_backward_elemt(dy, parts[0], mean, invstd, w_elemt, sum_dy, sum_dy_xmu, count)
        out[kernels.name] = [*stats[0], mean, invstd, *running, y, sum_dy, sum_dy_xmu, gw, gb, dx]
    names = ["mean0", "invstd0", "mean", "invstd", "running_mean", "running_var", "y", "sum_dy", "sum_dy_xmu"]
    names += ["grad_weight", "grad_bias", "dx"]
    # A per-channel sum can cancel to near zero, so its error is bounded by the size of its terms (float64):
    # the kernels may accumulate in another order (16-bit inputs: in lower precision) than the stand-in.
    x64, dy64 = parts[0].double(), dy.double()
    mean64 = x64.mean(dim=[0, 2, 3], keepdim=True)
    term_size = {
        "sum_dy": dy64.abs().sum(dim=[0, 2, 3]),
        "sum_dy_xmu": (dy64 * (x64 - mean64)).abs().sum(dim=[0, 2, 3]),
    }
    term_size["grad_bias"] = term_size["sum_dy"]
    term_size["grad_weight"] = term_size["sum_dy_xmu"] * out["torch"][3].double()
    for name, real, stand_in in zip(names, out["torch"], out["reference"], strict=True):
        assert stand_in.dtype == real.dtype, name
        if name in term_size:
            slack = (stand_in.double() - real.double()).abs() - tol["rtol"] * term_size[name]
            bad = bool((slack > tol["atol"]).any())
            assert not bad, f"{name}: {stand_in} vs {real} (size of the terms: {term_size[name]})"
        else:
            assert_close(stand_in.float(), real.float(), **tol, msg=name)
    assert out["reference"][-1].dtype == dtype


def test_cuda_tensors_get_torchs_operators() -> None:
    _torch_bn.fused_kernels_available.cache_clear()
    assert kernels_for(torch.device("cuda", 0)) is TORCH_KERNELS


def _patched_dp(module: nn.Module, ids: list[int]) -> nn.DataParallel[nn.Module]:
    return patch_replication_callback(nn.DataParallel(module.cuda(ids[0]), device_ids=ids))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_two_replicas_on_one_gpu_on_the_operators_match_the_full_batch(
    dtype: torch.dtype, channels_last: bool
) -> None:
    ref, ours = bn_pair(nn.BatchNorm2d, 4, dtype)
    kernels = _CountingTorch()
    ours._bn_kernels = kernels
    dev = torch.device("cuda", 0)
    ref = ref.to(dev)
    dp = _patched_dp(ours, [0, 0])
    gen = torch.Generator().manual_seed(1)
    tol = _tol(dtype)
    for _ in range(3):
        x = (torch.randn(9, 4, 3, 5, generator=gen, dtype=dtype) * 2 + 4).to(dev)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        g = torch.randn(9, 4, 3, 5, generator=gen, dtype=dtype).to(dev)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = ref(xa), dp(xb)
        (ya * g).sum().backward()
        (yb * g).sum().backward()
        assert_close(yb, ya, **tol, msg="output")
        assert_close(xb.grad, xa.grad, **tol, msg="input grad")
    assert_close(ours.weight.grad, ref.weight.grad, **tol, msg="weight grad")
    assert_close(ours.running_var, ref.running_var, **tol, msg="running var")
    assert kernels.calls["batch_norm_gather_stats_with_counts"] == 3
    assert kernels.calls["batch_norm_backward_elemt"] == 6


def test_autocast_fp16_on_the_operators_keeps_fp32_statistics() -> None:
    ref, ours = bn_pair(nn.BatchNorm2d, 4, torch.float32)
    kernels = _CountingTorch()
    ours._bn_kernels = kernels
    ref = ref.cuda(0)
    dp = _patched_dp(ours, [0, 0])
    x = torch.randn(8, 4, 5, 5, device="cuda:0") * 2 + 10
    with torch.autocast("cuda", dtype=torch.float16):
        y = dp(x.half())
    assert y.dtype == torch.float16
    assert ours.running_mean.dtype == torch.float32
    assert_close(y.float(), ref(x.half().float()), rtol=1e-2, atol=1e-2)
    assert_close(ours.running_mean, ref.running_mean, rtol=1e-4, atol=1e-4)
    assert kernels.calls["batch_norm_stats"] == 2


def test_two_ranks_sharing_one_gpu_on_the_operators_match_the_full_batch() -> None:
    results = pd.run_world(
        shared_gpu_fused_world,
        2,
        dist_backend="gloo",
        init_rpc=False,
        timeout=300,
        dist_timeout=60,
        start_method="spawn",
    )
    for rank, result in enumerate(results):
        for case, obs in result.items():
            tol = 1e-10 if "float64" in case else 1e-4
            bad = {k: v for k, v in obs["diff"].items() if not v <= tol}
            assert not bad, f"rank {rank}, {case}: {bad}"
            assert {"output", "input_grad", "weight_grad", "running_var"} <= set(obs["diff"]), case
