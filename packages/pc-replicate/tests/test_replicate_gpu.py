"""CUDA paths; skipped without CUDA, run by ``nox -s gpu`` (or ``tools/gpu_check.sh``).

Each test that needs two GPUs has a one-GPU form beside it: two replicas on one device (``device_ids=[0,
0]``), which torch's replicate, scatter and gather accept, so the same paths run on a one-GPU machine.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from replicate_testutils import assert_close
from torch import nn

from pc_replicate import (
    CallbackContext,
    Parallel,
    Parallelizable,
    ReplicationCallbackDataParallel,
    patch_replication_callback,
)

pytestmark = pytest.mark.gpu


@pytest.fixture
def two_gpus(cuda_devices: int) -> None:
    if cuda_devices < 2:
        pytest.skip("needs 2 or more CUDA devices")


class DeviceProbe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.calls: list[int] = []
        self.devices: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def __data_parallel_replicate__(self, ctx: CallbackContext, copy_id: int) -> None:
        self.calls.append(copy_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.devices.append((torch.cuda.current_device(), x.device.index))
        return self.lin(x)


@pytest.mark.parametrize(("device_ids", "output_device"), [([0, 1], None), ([0, 1], 1), ([1, 0], None)])
def test_matches_torch_data_parallel(
    two_gpus: None, device_ids: list[int], output_device: int | None
) -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).cuda(device_ids[0])
    x = torch.randn(8, 6, device=f"cuda:{device_ids[0]}")
    upstream = torch.randn(
        8, 3, device=f"cuda:{output_device if output_device is not None else device_ids[0]}"
    )
    ours = ReplicationCallbackDataParallel(module, device_ids, output_device)
    out = ours(x)
    (out * upstream).sum().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    expected = nn.DataParallel(module, device_ids, output_device)(x)
    (expected * upstream).sum().backward()
    assert out.device == expected.device
    assert_close(out, expected, atol=1e-5)
    for got, p in zip(grads, module.parameters(), strict=True):
        assert_close(got, p.grad, atol=1e-5)


@pytest.mark.parametrize("output_device", [None, 0])
def test_two_replicas_on_one_gpu_match_the_full_batch(output_device: int | None) -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).cuda(0)
    x = torch.randn(8, 6, device="cuda:0")
    upstream = torch.randn(8, 3, device="cuda:0")
    out = ReplicationCallbackDataParallel(module, [0, 0], output_device)(x)
    (out * upstream).sum().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    expected = module(x)  # the full batch on one module: no replica, no scatter
    (expected * upstream).sum().backward()
    assert out.device == expected.device
    assert_close(out, expected, atol=1e-5)
    for got, p in zip(grads, module.parameters(), strict=True):
        assert_close(got, p.grad, atol=1e-5)


def test_two_replicas_on_one_gpu_run_the_callbacks_of_patched_torch_dp() -> None:
    probe = DeviceProbe().cuda(0)
    dp = patch_replication_callback(nn.DataParallel(probe, [0, 0]))
    dp(torch.randn(4, 6, device="cuda:0"))
    assert sorted(probe.calls) == [0, 1]
    assert probe.devices == [(0, 0), (0, 0)]


class FailsInCopy1(nn.Module):
    """Raises in the replica whose copy id (from the replication callback) is 1, on any device layout."""

    copy_id = 0

    def __data_parallel_replicate__(self, ctx: CallbackContext, copy_id: int) -> None:
        self.copy_id = copy_id

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_id == 1:
            raise ValueError(f"replica copy 1 on cuda:{x.device.index} failed")
        return x


def test_replica_error_with_two_replicas_on_one_gpu_is_raised() -> None:
    with pytest.raises(ValueError, match="copy 1 on cuda:0 failed") as info:
        ReplicationCallbackDataParallel(FailsInCopy1(), [0, 0])(torch.randn(4, 2, device="cuda:0"))
    assert any("replica 1" in note for note in getattr(info.value, "__notes__", ["replica 1"]))


def test_fp16_autocast_reaches_two_replicas_on_one_gpu() -> None:
    module = nn.Linear(4, 4).cuda(0)
    x = torch.randn(4, 4, device="cuda:0")
    with torch.autocast("cuda", dtype=torch.float16):
        out = ReplicationCallbackDataParallel(module, [0, 0])(x)
        expected = module(x)
    assert out.dtype == torch.float16
    assert_close(out.float(), expected.float(), atol=1e-3)


def test_current_device_in_each_replica_and_patched_torch_dp(two_gpus: None) -> None:
    probe = DeviceProbe().cuda(0)
    dp = patch_replication_callback(nn.DataParallel(probe, [0, 1]))
    dp(torch.randn(4, 6, device="cuda:0"))
    assert sorted(probe.calls) == [0, 1]
    assert sorted(probe.devices) == [(0, 0), (1, 1)]


def test_cuda_replica_error_is_raised(two_gpus: None) -> None:
    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.device.index == 1:
                raise ValueError("replica on cuda:1 failed")
            return x

    with pytest.raises(ValueError, match="cuda:1 failed") as info:
        ReplicationCallbackDataParallel(Fails(), [0, 1])(torch.randn(4, 2, device="cuda:0"))
    assert any("replica 1" in note for note in getattr(info.value, "__notes__", []))


def test_fp16_autocast_reaches_the_replicas(two_gpus: None) -> None:
    module = nn.Linear(4, 4).cuda(0)
    with torch.autocast("cuda", dtype=torch.float16):
        out = ReplicationCallbackDataParallel(module, [0, 1])(torch.randn(4, 4, device="cuda:0"))
    assert out.dtype == torch.float16


def test_parallel_enters_the_device_of_each_item(two_gpus: None) -> None:
    # No one-GPU form: with one device, "entered the item's device" cannot be told from "stayed on cuda:0".
    class Where(Parallelizable):
        def forward_backward(self, x: Any) -> int:
            return torch.cuda.current_device()

    with Parallel(2, Where(), serial_init=False, ordered=True) as parallel:
        for device in (1, 0, 1):
            parallel.put(torch.zeros(1, device=f"cuda:{device}"))
        assert [parallel.get(timeout=60) for _ in range(3)] == [1, 0, 1]
