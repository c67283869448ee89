"""Numerics of synchronized batch norm on CPU thread replicas vs torch batch norm on the full batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sync_testutils import assert_close, bn_pair, compare_steps, replicated
from torch import nn

import pc_sync

CASES = [  # (torch class, input shape, replicas): every shape and every replica count at least once
    (nn.BatchNorm1d, (16, 10), 2),
    (nn.BatchNorm1d, (10, 6), 4),  # chunks 3,3,3,1
    (nn.BatchNorm1d, (7, 5, 9), 3),  # chunks 3,3,1
    (nn.BatchNorm2d, (8, 4, 5, 5), 2),
    (nn.BatchNorm2d, (8, 4, 5, 5), 4),
    (nn.BatchNorm2d, (9, 3, 2, 2), 4),  # 3 chunks of 3 on 4 devices
    (nn.BatchNorm2d, (5, 3, 2, 3), 4),  # chunks 2,2,1 on 4 devices
    (nn.BatchNorm3d, (4, 3, 2, 3, 5), 3),  # chunks 2,2
]


def _case_id(case: tuple[type[nn.Module], tuple[int, ...], int]) -> str:
    cls, shape, n = case
    return f"{cls.__name__}-{'x'.join(map(str, shape))}-{n}rep"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_float64_matches_full_batch(case: tuple[type[nn.Module], tuple[int, ...], int]) -> None:
    ref_cls, shape, n = case
    ref, ours = bn_pair(ref_cls, shape[1], torch.float64)
    compare_steps(ref, ours, shape, n, torch.float64)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"momentum": 0.1},
        {"momentum": 1.0},
        {"momentum": None},
        {"affine": False},
        {"bias": False},
        {"track_running_stats": False},
        {"track_running_stats": False, "affine": False},
        {"momentum": None, "eps": 1e-3},
    ],
    ids=str,
)
def test_options_match_full_batch(kwargs: dict[str, Any]) -> None:
    ref, ours = bn_pair(nn.BatchNorm2d, 4, torch.float64, **kwargs)
    compare_steps(ref, ours, (6, 4, 3, 3), 3, torch.float64)


@pytest.mark.parametrize("case", CASES[::3], ids=_case_id)
def test_float32_matches_full_batch(case: tuple[type[nn.Module], tuple[int, ...], int]) -> None:
    ref_cls, shape, n = case
    ref, ours = bn_pair(ref_cls, shape[1], torch.float32)
    compare_steps(ref, ours, shape, n, torch.float32)


def test_offset_1e3_data_float64_matches_full_batch() -> None:
    ref, ours = bn_pair(nn.BatchNorm2d, 4, torch.float64)
    compare_steps(ref, ours, (8, 4, 3, 3), 4, torch.float64, offset=1e3)


def test_offset_1e3_data_float32_is_as_accurate_as_torch() -> None:
    """At offset 1e3 fp32 inputs are rounded to ~6e-5, so compare both fp32 results with the float64 truth."""
    gen = torch.Generator().manual_seed(7)
    x64 = torch.randn(8, 4, 3, 3, generator=gen, dtype=torch.float64) * 2 + 1e3
    ours, ref32 = pc_sync.SynchronizedBatchNorm2d(4), nn.BatchNorm2d(4)
    truth = nn.BatchNorm2d(4, dtype=torch.float64)
    y64 = truth(x64)
    err_ours = (replicated(ours, 4)(x64.float()).double() - y64).abs().max().item()
    err_torch = (ref32(x64.float()).double() - y64).abs().max().item()
    assert err_ours < 2e-4, err_ours  # ulp(1e3) / std = 6e-5 / 2, with headroom
    assert err_ours <= 4 * err_torch, (err_ours, err_torch)
    assert_close(ours.running_var.double(), truth.running_var, rtol=1e-5, atol=1e-5)


def test_channels_last_input() -> None:
    ref, ours = bn_pair(nn.BatchNorm2d, 4, torch.float64)
    compare_steps(
        ref, ours, (8, 4, 3, 5), 3, torch.float64, layout=lambda t: t.to(memory_format=torch.channels_last)
    )


def test_non_contiguous_input() -> None:
    ref, ours = bn_pair(nn.BatchNorm2d, 4, torch.float64)

    def sliced(t: torch.Tensor) -> torch.Tensor:
        # a non-viewable, non-contiguous leaf: the last dim sliced, then transposed spatial dims
        return t.repeat(1, 1, 1, 2)[..., :5].transpose(2, 3).detach()

    compare_steps(ref, ours, (8, 4, 3, 5), 4, torch.float64, layout=sliced)


def test_offset_1e4_float32_stays_close_to_float64() -> None:
    """Chan's combination: fp32 data at offset 1e4 (std 3) stays within 1e-3 of the float64 result."""
    gen = torch.Generator().manual_seed(3)
    x64 = torch.randn(32, 3, 4, 4, generator=gen, dtype=torch.float64) * 3 + 1e4
    ours = pc_sync.SynchronizedBatchNorm2d(3, momentum=1.0)
    ref = nn.BatchNorm2d(3, momentum=1.0, dtype=torch.float64)
    y32 = replicated(ours, 4)(x64.float())
    y64 = ref(x64)
    assert (y32.double() - y64).abs().max().item() < 1e-3
    assert_close(ours.running_var.double(), ref.running_var, rtol=1e-3, atol=1e-3)
    assert_close(ours.running_mean.double(), ref.running_mean, rtol=1e-6, atol=1e-3)


def test_statistics_of_low_precision_inputs_are_float32() -> None:
    """bf16 input: fp32 statistics, bf16 output, close to the fp32 computation."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(8, 3, 4, generator=gen) * 2 + 5
    ours = pc_sync.SynchronizedBatchNorm1d(3)
    ref = nn.BatchNorm1d(3)
    y = replicated(ours, 2)(x.bfloat16())
    assert y.dtype == torch.bfloat16
    assert_close(y.float(), ref(x.bfloat16().float()), rtol=2e-2, atol=2e-2)
    assert ours.running_mean.dtype == torch.float32
    assert_close(ours.running_mean, ref.running_mean, rtol=1e-5, atol=1e-5)


def test_results_are_bitwise_deterministic() -> None:
    def run() -> tuple[torch.Tensor, ...]:
        _ref, ours = bn_pair(nn.BatchNorm2d, 4, torch.float32, seed=5)
        dp = replicated(ours, 4)
        gen = torch.Generator().manual_seed(6)
        x = torch.randn(10, 4, 3, 3, generator=gen).requires_grad_()
        y = dp(x)
        (y * torch.randn(y.shape, generator=gen)).sum().backward()
        assert x.grad is not None
        assert ours.weight.grad is not None
        return y.detach(), x.grad, ours.weight.grad, ours.running_var.clone()

    first = run()
    for _ in range(3):
        for a, b in zip(first, run(), strict=True):
            assert torch.equal(a, b)
