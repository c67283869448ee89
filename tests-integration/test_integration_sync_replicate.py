"""pc-sync on pc-replicate's CPU thread replicas equals single-device BatchNorm on the full batch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pc_replicate
import pc_sync


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 6 * 6, 5),
        nn.BatchNorm1d(5),
    )


@pytest.mark.parametrize("replicas", [2, 3])
def test_converted_model_on_thread_replicas_matches_full_batch(replicas: int) -> None:
    torch.manual_seed(0)
    reference = _net().double()
    with torch.no_grad():  # random affine parameters, so the test sees them
        for m in reference.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    synced = pc_sync.convert_model(copy.deepcopy(reference))
    assert sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in synced.modules()) == 2
    dp = pc_replicate.ReplicationCallbackDataParallel(synced, device_ids=["cpu"] * replicas)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt_dp = torch.optim.SGD(synced.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x = torch.randn(7, 3, 6, 6, dtype=torch.float64) * 4 + 100  # uneven chunks, a large offset
        upstream = torch.randn(7, 5, dtype=torch.float64)
        out_ref = reference(x)
        out_dp = dp(x)
        torch.testing.assert_close(out_dp, out_ref, rtol=1e-10, atol=1e-10, msg=f"output, step {step}")
        for opt, out in ((opt_ref, out_ref), (opt_dp, out_dp)):
            opt.zero_grad(set_to_none=True)
            (out * upstream).sum().backward()
        for (name, p_ref), p_dp in zip(reference.named_parameters(), synced.parameters(), strict=True):
            torch.testing.assert_close(p_dp.grad, p_ref.grad, rtol=1e-9, atol=1e-10, msg=f"grad of {name}")
        opt_ref.step()
        opt_dp.step()
    for (name, b_ref), b_dp in zip(reference.named_buffers(), synced.buffers(), strict=True):
        torch.testing.assert_close(b_dp, b_ref, rtol=1e-10, atol=1e-10, msg=f"buffer {name}")
    synced.eval()
    reference.eval()
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64) + 100
    torch.testing.assert_close(dp(x), reference(x), rtol=1e-10, atol=1e-10)


def test_replica_error_reaches_caller_through_sync_bn() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] == 1:  # only the last, smaller chunk fails
                raise ArithmeticError("replica-only failure")
            return x

    # The failing replica never reaches the batch norm its peers are waiting in: they must be released.
    model = nn.Sequential(Boom(), pc_sync.SynchronizedBatchNorm1d(4))
    dp = pc_replicate.ReplicationCallbackDataParallel(model, device_ids=["cpu"] * 3)
    with pytest.raises(ArithmeticError, match="replica-only failure"):
        dp(torch.randn(5, 4))
    # The module stays usable: the next forward with healthy chunks works.
    assert dp(torch.randn(6, 4)).shape == (6, 4)


@pytest.mark.parametrize("failing", [0, 2])  # the replica whose SyncBN is the master, and a slave's
def test_replica_error_releases_the_sync_bn_peers_by_the_abort(failing: int) -> None:
    """The peers waiting in SyncBN leave with SyncAbortedError (the abort), never SyncTimeoutError.

    Moved here from pc-replicate's own tests, which must not import pc-sync. The sync timeout is left at its
    default (minutes); the peers' error type shows what released them, so no clock is needed.
    """
    seen: list[str] = []

    class Recorder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = pc_sync.SynchronizedBatchNorm1d(3).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x[0, 0] > 100:
                raise ValueError("marked chunk")
            try:
                return self.bn(x)
            except Exception as exc:
                seen.append(type(exc).__name__)
                raise

    x = torch.randn(12, 3, dtype=torch.float64)
    x[4 * failing, 0] = 1000.0
    with pytest.raises(ValueError, match="marked chunk") as info:
        pc_replicate.ReplicationCallbackDataParallel(Recorder(), ["cpu"] * 3)(x)
    assert sorted(seen) == ["SyncAbortedError", "SyncAbortedError"]
    assert any(f"replica {failing}" in note for note in getattr(info.value, "__notes__", []))
