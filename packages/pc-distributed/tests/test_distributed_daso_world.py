"""DASO on 4 gloo processes as 2 simulated nodes x 2: phases, agreement after every epoch, falling loss."""

from __future__ import annotations

import distributed_dp_testutils as tu
import pytest
import torch

from pc_distributed import run_world

EPOCHS = 3
BATCHES = 4


def test_daso_two_simulated_nodes() -> None:
    results = run_world(
        tu.daso_worker, 4, args=(EPOCHS, BATCHES), init_rpc=False, timeout=170, dist_timeout=30
    )
    # warm-up (blocking), two cycling epochs (max_global_skips=2, then whatever the loss says), cool-down
    phases = results[0]["phases"]
    assert phases[0] == (0, 0, 0)
    assert phases[1] == (2, 1, 1)
    assert phases[-1] == (0, 0, 0)
    for r in results:
        assert r["phases"] == phases, "ranks disagree on the schedule"
        assert r["agree"] == [True] * EPOCHS, "ranks differ after an epoch's final synchronisation"
        assert r["epoch"] == EPOCHS
        assert r["params"] == results[0]["params"]
    losses = results[0]["losses"]
    assert losses[-1] < losses[0], f"loss did not decrease: {losses}"


@pytest.mark.gpu
def test_daso_gpu_nccl_two_nodes_of_one(cuda_devices: int) -> None:
    if cuda_devices < 2:
        pytest.skip("needs 2 CUDA devices: NCCL runs one rank per distinct GPU (the gloo form shares one)")
    results = run_world(tu.daso_gpu_worker, 2, init_rpc=False, dist_backend="nccl", timeout=170)
    assert results[0] == results[1]


@pytest.mark.gpu
def test_daso_gpu_two_nodes_of_one_sharing_one_gpu_over_gloo() -> None:
    results = run_world(tu.daso_gpu_worker, 2, args=(0,), init_rpc=False, dist_backend="gloo", timeout=170)
    assert results[0] == results[1]
    assert torch.tensor(results[0]).isfinite().all()


@pytest.mark.gpu
def test_dp_gpu_nccl_blocking_matches_across_ranks(cuda_devices: int) -> None:
    if cuda_devices < 2:
        pytest.skip("needs 2 CUDA devices: NCCL runs one rank per distinct GPU (the gloo form shares one)")
    results = run_world(tu.dp_gpu_worker, 2, init_rpc=False, dist_backend="nccl", timeout=170)
    assert results[0] == results[1]
    assert torch.tensor(results[0]).isfinite().all()


@pytest.mark.gpu
def test_dp_gpu_blocking_matches_across_ranks_sharing_one_gpu_over_gloo() -> None:
    results = run_world(tu.dp_gpu_worker, 2, args=(0,), init_rpc=False, dist_backend="gloo", timeout=170)
    assert results[0] == results[1]
    assert torch.tensor(results[0]).isfinite().all()
