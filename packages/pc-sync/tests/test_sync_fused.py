"""The CUDA path's orchestration on CPU: the fused kernels' stand-ins, and the replicas driven through them.

``pc_sync._torch_bn.REFERENCE_KERNELS`` has the signatures, results, dtype rules and refusals of torch's five
batch-norm kernels (CUDA only); a module whose ``_bn_kernels`` holds a kernel set runs the fused path on any
device. Every comparison is against torch's batch norm on the full batch (random weights, buffers and upstream
gradients), and every test checks that the kernels ran, so none passes on the composite path by mistake. The
process path (gloo) is in ``test_sync_pairings.py``; the real kernels in ``test_sync_fused_gpu.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from sync_testutils import CountingKernels, assert_close, bn_pair, compare_steps, replicated
from torch import nn

import pc_sync
from pc_sync import _torch_bn
from pc_sync._torch_bn import REFERENCE_KERNELS, TORCH_KERNELS, kernels_for

CASES = [  # (torch class, input shape, replicas): uneven chunks, every input rank
    (nn.BatchNorm1d, (16, 10), 2),
    (nn.BatchNorm1d, (10, 6), 4),  # chunks 3,3,3,1
    (nn.BatchNorm1d, (7, 5, 9), 3),  # chunks 3,3,1
    (nn.BatchNorm2d, (8, 4, 5, 5), 2),
    (nn.BatchNorm2d, (5, 3, 2, 3), 4),  # chunks 2,2,1 on 4 devices
    (nn.BatchNorm3d, (4, 3, 2, 3, 5), 3),  # chunks 2,2
]


def _case_id(case: tuple[type[nn.Module], tuple[int, ...], int]) -> str:
    cls, shape, n = case
    return f"{cls.__name__}-{'x'.join(map(str, shape))}-{n}rep"


def _fused_pair(
    ref_cls: type[nn.Module], channels: int, dtype: torch.dtype, **kwargs: Any
) -> tuple[nn.Module, nn.Module, CountingKernels]:
    ref, ours = bn_pair(ref_cls, channels, dtype, **kwargs)
    kernels = CountingKernels()
    ours._bn_kernels = kernels
    return ref, ours, kernels


def _assert_fused(kernels: CountingKernels, steps: int, replicas: int) -> None:
    """Every training step of every replica ran the five kernels (the gather once per step)."""
    per_replica = {
        "batch_norm_stats",
        "batch_norm_elemt",
        "batch_norm_backward_reduce",
        "batch_norm_backward_elemt",
    }
    for name in per_replica:
        assert kernels.calls[name] >= steps * 2, (name, kernels.calls)
    assert kernels.calls["batch_norm_gather_stats_with_counts"] == steps, kernels.calls


# ------------------------------------------------------------------------------------ the stand-ins alone
def _batch(dtype: torch.dtype = torch.float64, shape: tuple[int, ...] = (6, 3, 4, 5)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 3).to(dtype)


def test_stand_ins_on_one_part_are_torchs_batch_norm_forward_and_backward() -> None:
    k = REFERENCE_KERNELS
    x = _batch().requires_grad_()
    gen = torch.Generator().manual_seed(1)
    w = torch.rand(3, generator=gen, dtype=torch.float64) + 0.5
    b = torch.randn(3, generator=gen, dtype=torch.float64)
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    y = F.batch_norm(x, None, None, w, b, training=True, eps=1e-3)
    (y * dy).sum().backward()
    mean, invstd = k.batch_norm_stats(x.detach(), 1e-3)
    rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    counts = torch.tensor([float(x.numel() // 3)], dtype=torch.float64)
    gmean, ginvstd = k.batch_norm_gather_stats_with_counts(
        x, mean[None], invstd[None], rm, rv, 0.5, 1e-3, counts
    )
    assert_close(gmean, mean, rtol=1e-12, atol=1e-12)
    assert_close(ginvstd, invstd, rtol=1e-12, atol=1e-12)
    var = x.detach().var([0, 2, 3], correction=1)
    assert_close(rv, 0.5 + 0.5 * var, rtol=1e-12, atol=1e-12)
    assert_close(k.batch_norm_elemt(x.detach(), w, b, mean, invstd, 1e-3), y.detach(), rtol=1e-12, atol=1e-12)
    sum_dy, sum_dy_xmu, gw, gb = k.batch_norm_backward_reduce(
        dy, x.detach(), mean, invstd, w, True, True, True
    )
    assert sum_dy is not None
    assert sum_dy_xmu is not None
    assert gw is not None
    assert gb is not None
    count = torch.tensor([x.numel() // 3], dtype=torch.int32)
    dx = k.batch_norm_backward_elemt(dy, x.detach(), mean, invstd, w, sum_dy, sum_dy_xmu, count)
    assert x.grad is not None
    assert_close(dx, x.grad, rtol=1e-10, atol=1e-12)
    assert_close(gb, dy.sum([0, 2, 3]), rtol=1e-12, atol=1e-12)
    reference_gw = (dy * (x.detach() - mean[None, :, None, None]) * invstd[None, :, None, None]).sum(
        [0, 2, 3]
    )
    assert_close(gw, reference_gw, rtol=1e-12, atol=1e-12)


def test_stand_in_gather_combines_parts_like_the_whole() -> None:
    k = REFERENCE_KERNELS
    x = _batch(shape=(9, 3, 2, 2))
    parts = [x[:2], x[2:3], x[3:]]
    stats = [k.batch_norm_stats(p, 1e-5) for p in parts]
    counts = torch.tensor([float(p.numel() // 3) for p in parts], dtype=torch.float64)
    means = torch.stack([m for m, _ in stats])
    invstds = torch.stack([i for _, i in stats])
    mean, invstd = k.batch_norm_gather_stats_with_counts(x, means, invstds, None, None, 0.0, 1e-5, counts)
    whole_mean, whole_invstd = k.batch_norm_stats(x, 1e-5)
    assert_close(mean, whole_mean, rtol=1e-12, atol=1e-12)
    assert_close(invstd, whole_invstd, rtol=1e-10, atol=1e-12)


def test_stand_ins_keep_the_kernels_dtype_rules() -> None:
    k = REFERENCE_KERNELS
    x16 = _batch(torch.float16)
    mean, invstd = k.batch_norm_stats(x16, 1e-5)
    assert mean.dtype == invstd.dtype == torch.float32  # fp16 input: fp32 statistics
    w32 = torch.ones(3)
    y = k.batch_norm_elemt(x16, w32, torch.zeros(3), mean, invstd, 1e-5)  # a "mixed" fp32 weight
    assert y.dtype == torch.float16
    x32 = _batch(torch.float32)
    with pytest.raises(RuntimeError, match=r"Expected mean to have type torch\.float32"):
        k.batch_norm_elemt(x32, None, None, mean.double(), invstd.double(), 1e-5)
    with pytest.raises(RuntimeError, match="Expected weight"):
        k.batch_norm_elemt(x32, w32.double(), None, mean, invstd, 1e-5)
    with pytest.raises(RuntimeError, match="Expected counts"):
        k.batch_norm_gather_stats_with_counts(
            x32, mean[None], invstd[None], None, None, 0.0, 1e-5, torch.tensor([4.0], dtype=torch.float64)
        )
    sums = torch.zeros(3)
    with pytest.raises(RuntimeError, match=r"Expected count to have type torch\.int32"):
        k.batch_norm_backward_elemt(x32, x32, mean, invstd, None, sums, sums, torch.tensor([120]))
    channels_last = _batch(torch.float32).contiguous(memory_format=torch.channels_last)
    out = k.batch_norm_elemt(channels_last, None, None, mean, invstd, 1e-5)
    assert out.is_contiguous(memory_format=torch.channels_last)


def test_stand_ins_refuse_what_cuda_leaves_undefined() -> None:
    k = REFERENCE_KERNELS
    empty = torch.empty(0, 3, 2)
    with pytest.raises(ValueError, match="empty input"):
        k.batch_norm_stats(empty, 1e-5)
    mean, invstd = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="count below 1"):
        k.batch_norm_gather_stats_with_counts(
            empty, mean, invstd, None, None, 0.0, 1e-5, torch.tensor([0.0, 4.0])
        )


# --------------------------------------------------------------------------------- which kernels, where
def test_kernels_are_chosen_per_device_behind_the_capability_check(monkeypatch: pytest.MonkeyPatch) -> None:
    _torch_bn.fused_kernels_available.cache_clear()
    try:
        assert _torch_bn.fused_kernels_available()  # every torch of the matrix has the five operators
        assert kernels_for(torch.device("cuda", 0)) is TORCH_KERNELS
        assert kernels_for(torch.device("cpu")) is None  # CPU keeps the composite float64 path
        assert kernels_for(torch.device("cpu"), REFERENCE_KERNELS) is REFERENCE_KERNELS
        _torch_bn.fused_kernels_available.cache_clear()
        monkeypatch.delattr(torch, "batch_norm_gather_stats_with_counts")
        assert not _torch_bn.fused_kernels_available()
        assert kernels_for(torch.device("cuda", 0)) is None  # a torch without one of them: composite
    finally:
        _torch_bn.fused_kernels_available.cache_clear()


def test_parameters_the_kernels_cannot_read_keep_the_composite_path() -> None:
    ref, ours, kernels = _fused_pair(nn.BatchNorm2d, 3, torch.float64)
    y = replicated(ours, 2)(_batch(torch.float32))  # a float32 input, float64 parameters
    assert sum(kernels.calls.values()) == 0
    assert y.dtype == torch.float32
    assert_close(y.double(), ref(_batch(torch.float32).double()), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- the replicas' fused path
@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_fused_replicas_match_the_full_batch(
    case: tuple[type[nn.Module], tuple[int, ...], int], dtype: torch.dtype
) -> None:
    ref_cls, shape, n = case
    ref, ours, kernels = _fused_pair(ref_cls, shape[1], dtype)
    compare_steps(ref, ours, shape, n, dtype, steps=3)
    _assert_fused(kernels, 3, n)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"momentum": None},
        {"momentum": 1.0, "eps": 1e-3},
        {"affine": False},
        {"bias": False},
        {"track_running_stats": False},
        {"track_running_stats": False, "affine": False},
    ],
    ids=str,
)
def test_fused_options_match_the_full_batch(kwargs: dict[str, Any]) -> None:
    ref, ours, kernels = _fused_pair(nn.BatchNorm2d, 4, torch.float64, **kwargs)
    compare_steps(ref, ours, (7, 4, 3, 3), 3, torch.float64)  # 3 training steps, then eval
    _assert_fused(kernels, 3, 3)


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(lambda t: t.to(memory_format=torch.channels_last), id="channels_last"),
        pytest.param(lambda t: t.repeat(1, 1, 1, 2)[..., :5].transpose(2, 3).detach(), id="non_contiguous"),
    ],
)
def test_fused_layouts_match_the_full_batch(layout: Any) -> None:
    ref, ours, kernels = _fused_pair(nn.BatchNorm2d, 4, torch.float64)
    compare_steps(ref, ours, (8, 4, 3, 5), 3, torch.float64, layout=layout)
    _assert_fused(kernels, 3, 3)


def test_fused_channels_last_output_stays_channels_last() -> None:
    _ref, ours, _kernels = _fused_pair(nn.BatchNorm2d, 4, torch.float32)
    x = _batch(torch.float32, (8, 4, 3, 5)).contiguous(memory_format=torch.channels_last)
    assert replicated(ours, 2)(x).is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16], ids=str)
def test_fused_low_precision_input_gets_fp32_statistics(low: torch.dtype) -> None:
    ref, ours, kernels = _fused_pair(nn.BatchNorm2d, 3, torch.float32)
    truth = nn.BatchNorm2d(3, dtype=torch.float64)
    truth.load_state_dict(ref.state_dict())
    x = (_batch(torch.float64, (8, 3, 4, 4)) * 2 + 10).to(low)
    xa = x.clone().requires_grad_()
    y = replicated(ours, 2)(xa)
    assert y.dtype == low
    assert ours.running_mean.dtype == torch.float32
    y_true = truth(x.double().requires_grad_())
    tol = 2e-2 if low == torch.float16 else 1e-1  # the output's own rounding
    assert_close(y.double(), y_true.detach(), rtol=tol, atol=tol)
    # fp32 statistics of the (rounded) input: the running statistics are those of fp32 arithmetic
    assert_close(ours.running_mean, truth.running_mean.float(), rtol=1e-5, atol=1e-5)
    assert_close(ours.running_var, truth.running_var.float(), rtol=1e-4, atol=1e-4)
    (y.float() * torch.ones_like(y, dtype=torch.float32)).sum().backward()
    assert xa.grad is not None
    assert xa.grad.dtype == low
    assert kernels.calls["batch_norm_backward_elemt"] == 2


def test_fused_weight_only_gradients_and_no_input_gradient() -> None:
    ref, ours, kernels = _fused_pair(nn.BatchNorm2d, 3, torch.float64)
    x, g = _batch(), _batch() - 3
    (replicated(ours, 3)(x) * g).sum().backward()  # the input needs no gradient
    (ref(x) * g).sum().backward()
    assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-10, atol=1e-10)
    assert_close(ours.bias.grad, ref.bias.grad, rtol=1e-10, atol=1e-10)
    assert kernels.calls["batch_norm_backward_elemt"] == 0
    assert kernels.calls["batch_norm_backward_reduce"] == 3


def test_fused_two_layers_and_a_layer_called_twice() -> None:
    kernels = CountingKernels()
    ref = nn.Sequential(nn.BatchNorm1d(4, dtype=torch.float64), nn.BatchNorm1d(4, dtype=torch.float64))
    ours = nn.Sequential(*(pc_sync.SynchronizedBatchNorm1d(4, dtype=torch.float64) for _ in range(2)))
    ours.load_state_dict(ref.state_dict())
    twice = pc_sync.SynchronizedBatchNorm1d(4, dtype=torch.float64)
    twice_ref = nn.BatchNorm1d(4, dtype=torch.float64)
    for m in (*ours, twice):
        m._bn_kernels = kernels
    x = _batch(shape=(10, 4, 3)).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    outs = [replicated(ours, 4)(x), replicated(nn.Sequential(twice, twice), 4)(x)]
    refs = [ref(xr), twice_ref(twice_ref(xr))]
    g = _batch(shape=(10, 4, 3)) - 3
    ((outs[0] * g).sum() + (outs[1] * g).sum()).backward()
    ((refs[0] * g).sum() + (refs[1] * g).sum()).backward()
    for a, b in zip(outs, refs, strict=True):
        assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert x.grad is not None
    assert xr.grad is not None
    assert_close(x.grad, xr.grad, rtol=1e-10, atol=1e-10)
    assert_close(twice.running_var, twice_ref.running_var, rtol=1e-10, atol=1e-10)
    assert int(twice.num_batches_tracked) == 2
    assert kernels.calls["batch_norm_gather_stats_with_counts"] == 4
