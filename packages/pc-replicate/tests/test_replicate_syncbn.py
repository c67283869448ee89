"""CPU thread replicas with pc-sync's synchronized batch norm (skipped when pc-sync is not installed)."""

from __future__ import annotations

import time

import pytest
import torch
from replicate_testutils import assert_close
from torch import nn

from pc_replicate import ReplicationCallbackDataParallel

pc_sync = pytest.importorskip("pc_sync")


class FailingSyncNet(nn.Module):
    """SyncBN behind a gate that raises in the replica whose first row is marked."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = pc_sync.SynchronizedBatchNorm1d(3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x[0, 0] > 100:
            raise ValueError("marked chunk")
        return self.bn(x)


def test_sync_bn_on_thread_replicas_equals_full_batch_bn() -> None:
    net = FailingSyncNet()
    reference = nn.BatchNorm1d(3).double()
    x = torch.randn(12, 3, dtype=torch.float64)
    assert_close(ReplicationCallbackDataParallel(net, ["cpu"] * 3)(x), reference(x), atol=1e-10)


@pytest.mark.parametrize("failing", [0, 2])
def test_replica_error_with_sync_bn_reaches_caller_fast(failing: int, no_thread_leak: None) -> None:
    x = torch.randn(12, 3, dtype=torch.float64)
    x[4 * failing, 0] = 1000.0
    start = time.monotonic()
    with pytest.raises(ValueError, match="marked chunk") as info:
        ReplicationCallbackDataParallel(FailingSyncNet(), ["cpu"] * 3)(x)
    assert time.monotonic() - start < 60.0  # the abort, not the 300 s sync timeout (generous: shared machine)
    assert any(
        f"replica {failing}" in note for note in getattr(info.value, "__notes__", [f"replica {failing}"])
    )
