"""pc-assigner places a model's parts, then pc-replicate runs the placed model on CPU thread replicas."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pc_assigner
import pc_replicate
import pc_sync


def _parts() -> list[nn.Module]:
    torch.manual_seed(1)
    return [
        nn.Sequential(nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU()),
        nn.Sequential(nn.Linear(32, 32), nn.ReLU()),
        nn.Linear(32, 3),
    ]


def test_placed_parts_run_replicated_like_the_direct_call() -> None:
    parts = [p.double() for p in _parts()]
    assigner = pc_assigner.ModelAssigner(
        parts,
        {(0, 1): 32, (1, 2): 32},
        devices=["cpu"],
        device_memory={"cpu": 1 << 30},
        move_models=True,
    )
    assert assigner.assignment == [torch.device("cpu")] * 3
    for part, device in zip(parts, assigner.assignment, strict=True):
        assert all(p.device == device for p in part.parameters())
    model = pc_sync.convert_model(nn.Sequential(*parts))
    reference = copy.deepcopy(model)
    dp = pc_replicate.ReplicationCallbackDataParallel(model, device_ids=["cpu", "cpu"])
    x = torch.randn(9, 12, dtype=torch.float64)
    upstream = torch.randn(9, 3, dtype=torch.float64)
    out, out_ref = dp(x), reference(x)
    torch.testing.assert_close(out, out_ref, rtol=1e-10, atol=1e-10)
    (out * upstream).sum().backward()
    (out_ref * upstream).sum().backward()
    for p, p_ref in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-9, atol=1e-10)


def test_memory_limits_split_parts_and_infeasible_placement_moves_nothing() -> None:
    parts = _parts()
    # Three simulated GPUs, each with room for the largest part but not for all three together.
    per_part_bytes = max(pc_assigner.ModelSizeEstimator(p, size_multiplier=1).estimate_size() for p in parts)
    capacity = int(per_part_bytes * 2**20 * 2 * 1.5)  # multiplier 2, and room for one part only
    assigner = pc_assigner.ModelAssigner(
        parts,
        {(0, 1): 1, (1, 2): 1},
        devices=["cuda:0", "cuda:1", "cuda:2"],
        device_memory={"cuda:0": capacity, "cuda:1": capacity, "cuda:2": capacity},
        max_mem_ratio=1.0,
        move_models=False,
    )
    used: dict[str, float] = {}
    for part, device in zip(parts, assigner.assignment, strict=True):
        mib = pc_assigner.ModelSizeEstimator(part, size_multiplier=2).estimate_size()
        used[str(device)] = used.get(str(device), 0.0) + mib * 2**20
    assert len(used) >= 2, f"all parts on one device although they do not fit: {assigner.assignment}"
    assert all(total <= capacity for total in used.values()), (used, capacity)
    assert all(p.device.type == "cpu" for part in parts for p in part.parameters())  # move_models=False
    with pytest.raises(RuntimeError, match="Estimated model will use"):
        pc_assigner.ModelAssigner(parts, {}, devices=["cpu"], device_memory={"cpu": 1024}, move_models=True)
    assert all(p.device.type == "cpu" for part in parts for p in part.parameters())
