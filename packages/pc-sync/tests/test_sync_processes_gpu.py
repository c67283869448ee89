"""pc_sync.SyncBatchNorm on GPUs: against torch.nn.SyncBatchNorm under DDP with NCCL (2 GPUs), and two ranks
sharing one GPU over gloo (against torch's batch norm on the full batch, float64).

Every test carries the ``gpu`` marker and skips itself without enough CUDA devices.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sync_world_workers import nccl_vs_torch_world, shared_gpu_world

pd = pytest.importorskip("pc_distributed")

pytestmark = pytest.mark.gpu


def _world(fn: Any, size: int, backend: str) -> list[Any]:
    return pd.run_world(  # type: ignore[no-any-return]
        fn, size, backend=backend, init_rpc=False, timeout=300, dist_timeout=60, start_method="spawn"
    )


def test_two_ranks_sharing_one_gpu_over_gloo_match_the_full_batch() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for rank, result in enumerate(_world(shared_gpu_world, 2, "gloo")):
        for case, obs in result.items():
            assert {"output", "input_grad", "weight_grad", "running_var"} <= set(obs["diff"])
            bad = {k: v for k, v in obs["diff"].items() if not v <= 1e-10}
            assert not bad, f"rank {rank}, {case}: {bad}"
            # CUDA tensors: the backward sum is an all_reduce; the group's first exchange widens its packets
            # to the layer's channels first (one more all_gather, once)
            first = 2 if case == "4d" else 1
            expected = [
                {"forward": {"all_gather": gathers}, "backward": {"all_reduce": 1}} for gathers in (first, 1)
            ]
            assert obs["collectives"][:-1] == expected


def test_matches_torch_sync_batch_norm_under_ddp_with_nccl() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    for rank, diff in enumerate(_world(nccl_vs_torch_world, 2, "nccl")):
        assert {"outputs", "1.running_var", "4.weight"} <= set(diff)
        bad = {k: v for k, v in diff.items() if not v <= 1e-4}
        assert not bad, f"rank {rank}: {bad}"
