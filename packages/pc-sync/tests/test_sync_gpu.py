"""CUDA paths: real DataParallel, autocast, channels_last, abort, nn.SyncBatchNorm under DDP.

Every test here carries the ``gpu`` marker (skipped without CUDA). The replica tests run with two replicas on
one GPU (``[0, 0]``) everywhere and across two GPUs where there are two; the comparison with
``torch.nn.SyncBatchNorm`` under DDP needs NCCL, which needs one distinct GPU per rank.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp
from sync_testutils import assert_close, bn_pair, ddp_sync_bn_worker
from torch import nn

from pc_replicate import patch_replication_callback
from pc_sync import SynchronizedBatchNorm2d

pytestmark = pytest.mark.gpu


def _need_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")


def _need(ids: list[int]) -> None:
    if len(set(ids)) > 1:
        _need_two_gpus()


# Two replicas on one GPU, then across two GPUs (skipped with fewer).
REPLICA_IDS = [pytest.param([0, 0], id="one-gpu"), pytest.param([0, 1], id="two-gpus")]


def _patched_dp(module: nn.Module, ids: list[int]) -> nn.DataParallel[nn.Module]:
    return patch_replication_callback(nn.DataParallel(module.cuda(ids[0]), device_ids=ids))


@pytest.mark.parametrize("ids", [[0, 0], [0, 1], [1, 0]])
def test_real_data_parallel_matches_full_batch(ids: list[int]) -> None:
    _need(ids)
    ref, ours = bn_pair(nn.BatchNorm2d, 4, torch.float64)
    dev = torch.device("cuda", ids[0])
    ref = ref.to(dev)
    dp = _patched_dp(ours, ids)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(8, 4, 3, 3, generator=gen, dtype=torch.float64).to(dev)
        g = torch.randn(8, 4, 3, 3, generator=gen, dtype=torch.float64).to(dev)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = ref(xa), dp(xb)
        assert_close(yb, ya, rtol=1e-10, atol=1e-10)
        (ya * g).sum().backward()
        (yb * g).sum().backward()
        assert_close(xb.grad, xa.grad, rtol=1e-10, atol=1e-10)
    assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-10, atol=1e-10)
    assert_close(ours.running_var, ref.running_var, rtol=1e-10, atol=1e-10)
    assert int(ours.num_batches_tracked) == 3


@pytest.mark.parametrize("ids", REPLICA_IDS)
def test_fp16_autocast_keeps_fp32_buffers(ids: list[int]) -> None:
    _need(ids)
    ref, ours = bn_pair(nn.BatchNorm2d, 4, torch.float32)
    ref = ref.cuda(0)
    dp = _patched_dp(ours, ids)
    x = torch.randn(8, 4, 5, 5, device="cuda:0")
    with torch.autocast("cuda", dtype=torch.float16):
        y = dp(x.half())
    assert y.dtype == torch.float16
    assert ours.running_mean.dtype == torch.float32
    assert_close(y.float(), ref(x.half().float()), rtol=1e-2, atol=1e-2)
    assert_close(ours.running_mean, ref.running_mean, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("ids", REPLICA_IDS)
def test_channels_last_on_gpus(ids: list[int]) -> None:
    _need(ids)
    ref, ours = bn_pair(nn.BatchNorm2d, 4, torch.float64)
    ref = ref.cuda(0)
    dp = _patched_dp(ours, ids)
    x = torch.randn(8, 4, 5, 3, dtype=torch.float64, device="cuda:0").to(memory_format=torch.channels_last)
    assert_close(dp(x), ref(x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("ids", REPLICA_IDS)
def test_replica_error_on_gpu_does_not_hang(ids: list[int]) -> None:
    _need(ids)

    class FailOnSecond(nn.Module):
        copy_id = 0

        def __init__(self) -> None:
            super().__init__()
            self.bn = SynchronizedBatchNorm2d(3, sync_timeout=60.0)

        def __data_parallel_replicate__(self, ctx: object, copy_id: int) -> None:
            self.copy_id = copy_id

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.copy_id == 1:
                raise KeyError(f"replica 1 on cuda:{x.device.index} failed")
            try:
                return self.bn(x)  # type: ignore[no-any-return]
            except Exception as exc:
                seen.append(type(exc).__name__)
                raise

    seen: list[str] = []
    dp = _patched_dp(FailOnSecond(), ids)
    with pytest.raises(KeyError, match=rf"replica 1 on cuda:{ids[1]} failed"):
        dp(torch.randn(8, 3, 2, 2, device="cuda:0"))
    assert seen == ["SyncAbortedError"]  # the peer on cuda:0 was released by the abort, not the 60 s timeout


def test_matches_torch_sync_batch_norm_under_ddp() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices: NCCL runs one rank per distinct GPU (no one-GPU form)")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, 3, 3, generator=gen)
    g = torch.randn(8, 4, 3, 3, generator=gen)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=ddp_sync_bn_worker, args=(rank, 2, tmp, x, g), daemon=True)
            for rank in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join(10)
        assert not alive, "DDP workers did not finish within 120 s"
        assert [p.exitcode for p in procs] == [0, 0]
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
    ref_y = torch.cat([r["y"] for r in results])
    ref_xgrad = torch.cat([r["xgrad"] for r in results])

    ours = SynchronizedBatchNorm2d(4)
    dp = _patched_dp(ours, [0, 1])
    xb = x.cuda(0).requires_grad_()
    yb = dp(xb)
    (yb * g.cuda(0)).sum().backward()
    assert_close(yb.cpu(), ref_y, rtol=1e-5, atol=1e-5)
    assert_close(xb.grad.cpu(), ref_xgrad, rtol=1e-5, atol=1e-5)
    wgrad = results[0]["wgrad"] + results[1]["wgrad"]
    assert_close(ours.weight.grad.cpu(), wgrad, rtol=1e-5, atol=1e-5)
    assert_close(ours.running_var.cpu(), results[0]["running_var"], rtol=1e-5, atol=1e-5)
