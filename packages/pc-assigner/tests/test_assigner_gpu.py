"""CUDA paths: probing free memory with torch.cuda.mem_get_info and moving models (run by ``nox -s gpu``)."""

from __future__ import annotations

import pytest
import torch

from pc_assigner import ModelAssigner, ModelSizeEstimator


@pytest.mark.gpu
def test_probe_reads_free_cuda_memory_and_moves_models() -> None:
    free, _total = torch.cuda.mem_get_info(0)
    models = [torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)]
    a = ModelAssigner(models, {(0, 1): 1}, devices=["cuda:0"], max_mem_ratio=0.5)
    assert a.problem.capacities[0] <= free * 0.5 * 1.01  # the probe read (at most) the free memory once
    assert [str(d) for d in a.assignment] == ["cuda:0", "cuda:0"]
    assert all(p.device == torch.device("cuda", 0) for m in models for p in m.parameters())


@pytest.mark.gpu
def test_default_devices_include_every_visible_gpu(cuda_devices: int) -> None:
    a = ModelAssigner([torch.nn.Linear(4, 4)], {}, move_models=False)
    assert a.devices == [torch.device("cuda", i) for i in range(cuda_devices)] + [torch.device("cpu")]
    assert a.assignment[0].type == "cuda"  # cpu_weight=0 keeps work off the CPU


@pytest.mark.gpu
def test_estimator_counts_cuda_tensors_like_cpu_ones() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).cuda().to(torch.bfloat16)
    assert ModelSizeEstimator(model, 1).get_parameter_sizes() * 2**20 == (12 + 4 + 4 + 4) * 2
