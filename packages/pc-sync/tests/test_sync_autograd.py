"""The hand-written backward of a training replica (pc_sync._autograd) against torch's batch norm."""

from __future__ import annotations

import pytest
import torch
from sync_testutils import bn_pair, replicated
from torch import nn
from torch.testing import assert_close

from pc_sync import _autograd


def _inputs(shape: tuple[int, ...], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 3
    g = torch.randn(shape, generator=gen, dtype=torch.float64)
    return x, g


def test_weight_only_grad_then_full_backward_matches_torch() -> None:
    """A backward that takes only the weights' gradient leaves no stale hand-over for the next full one."""
    ref, ours = bn_pair(nn.BatchNorm2d, 3, torch.float64)
    x, g = _inputs((8, 3, 4, 5))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = ref(xa)
    y_ours = replicated(ours, 2)(xb)
    (gw_ref,) = torch.autograd.grad((y_ref * g).sum(), [ref.weight], retain_graph=True)
    (gw_ours,) = torch.autograd.grad((y_ours * g).sum(), [ours.weight], retain_graph=True)
    assert_close(gw_ours, gw_ref, rtol=1e-10, atol=1e-10)
    g2 = g.flip(0)  # a different upstream gradient: a stale hand-over would give the first one's dx
    (y_ref * g2).sum().backward()
    (y_ours * g2).sum().backward()
    assert xa.grad is not None
    assert xb.grad is not None
    assert_close(xb.grad, xa.grad, rtol=1e-10, atol=1e-10)


def test_output_used_twice_and_input_grad_only() -> None:
    """Two uses of the output sum their gradients; ``autograd.grad`` of the input alone is exact."""
    ref, ours = bn_pair(nn.BatchNorm2d, 4, torch.float64)
    x, g = _inputs((6, 4, 3, 3), seed=2)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_ours = ref(xa), replicated(ours, 3)(xb)
    loss_ref = (y_ref * g).sum() + y_ref.square().sum()
    loss_ours = (y_ours * g).sum() + y_ours.square().sum()
    (dx_ref,) = torch.autograd.grad(loss_ref, [xa])
    (dx_ours,) = torch.autograd.grad(loss_ours, [xb])
    assert_close(dx_ours, dx_ref, rtol=1e-10, atol=1e-10)


def test_input_without_grad_still_gives_parameter_grads() -> None:
    ref, ours = bn_pair(nn.BatchNorm2d, 3, torch.float64)
    x, g = _inputs((8, 3, 2, 2), seed=3)
    (ref(x) * g).sum().backward()
    (replicated(ours, 2)(x) * g).sum().backward()
    for name in ("weight", "bias"):
        assert_close(getattr(ours, name).grad, getattr(ref, name).grad, rtol=1e-10, atol=1e-10)


def test_double_backward_through_a_replica_raises() -> None:
    """The hand-written backward is once-differentiable: a second-order gradient fails loudly, not wrongly."""
    _, ours = bn_pair(nn.BatchNorm2d, 3, torch.float64)
    x, g = _inputs((8, 3, 2, 2), seed=4)
    x.requires_grad_()
    y = replicated(ours, 2)(x)
    (dx,) = torch.autograd.grad((y * g).sum(), [x], create_graph=True)
    with pytest.raises(RuntimeError, match=r"once_differentiable|twice"):
        dx.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_fused_affine_is_a_per_channel_multiply_add(dtype: torch.dtype, channels_last: bool) -> None:
    # The fused pass is batch_norm with var + eps == 1; torch releases that reject eps=0 must still run it,
    # and the scale 1 / sqrt(var + eps) must be exactly 1 in every dtype (no drift from the plain product).
    gen = torch.Generator().manual_seed(3)
    t = torch.randn(4, 5, 3, 3, generator=gen, dtype=torch.float64).to(dtype)
    if channels_last:
        t = t.contiguous(memory_format=torch.channels_last)
    factor = torch.randn(5, generator=gen, dtype=torch.float64).to(dtype)
    offset = torch.randn(5, generator=gen, dtype=torch.float64).to(dtype)
    got = _autograd.channel_affine(t, factor, offset)
    ref = t.double() * factor.double().view(1, 5, 1, 1) + offset.double().view(1, 5, 1, 1)
    tol = {torch.float64: 1e-14, torch.float32: 1e-6, torch.bfloat16: 2e-2}[dtype]
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)
