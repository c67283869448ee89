"""ElasticDataParallel with a CUDA module (skipped without CUDA; run by ``nox -s gpu``).

On gloo groups (the default) a CUDA module's sums and the state handed to a joiner travel through host
memory; two members share one GPU (gloo allows it), so one device is enough. On NCCL groups each member needs
a GPU of its own (NCCL refuses two members on one device): those tests need two.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch
from distributed_elastic_testutils import FAST, SAMPLER, X, Y, make_model, make_optimizer, params, replay

import pc_distributed as pd


def _cuda_member(
    rank: int, steps: int, dist_backend: str = "gloo", kill_at: int | None = None
) -> dict[str, Any]:
    """Member ``str(rank)`` on cuda:0 (gloo) or cuda:<rank> (NCCL); member "1" dies in step ``kill_at``."""
    torch.set_num_threads(1)
    device = torch.device("cuda", 0 if dist_backend == "gloo" else rank)
    torch.cuda.set_device(device)
    name = str(rank)
    model = make_model(name).to(device)
    x, y = X.to(device), Y.to(device)

    def compute(ctx: pd.StepContext) -> int:
        if ctx.step == kill_at and name == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        idx = SAMPLER.indices(ctx.step, ctx.members, ctx.member)
        torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        return len(idx)

    with pd.ElasticDataParallel(
        model,
        make_optimizer(model),
        name=name,
        job="gpu",
        initial_members=2,
        dist_backend=dist_backend,
        **FAST,
    ) as edp:
        while edp.step < steps:
            edp.train_step(compute)
        return {
            "params": [t.cpu() for t in params(model)],
            "devices": sorted({str(t.device) for t in params(model)}),
            "log": [tuple(e) for e in edp.quorum_log],
            "aborted": edp.aborted_attempts,
        }


@pytest.mark.gpu
def test_a_cuda_module_trains_on_gloo_groups_and_equals_the_replay() -> None:
    results = pd.run_world(_cuda_member, 2, args=(4,), init_rpc=False, timeout=240)
    log = results[0]["log"]
    assert log == [(s, ("0", "1")) for s in range(4)]
    assert all(r["devices"] == ["cuda:0"] for r in results)
    expected = replay(log)  # on the CPU, in float64: the GPU's float64 kernels round differently
    for r in results:
        for got, want in zip(r["params"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


_TWO_GPUS = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="NCCL groups need a GPU per member"
)


@pytest.mark.gpu
@_TWO_GPUS
def test_nccl_groups_train_on_two_gpus_and_equal_the_replay() -> None:
    results = pd.run_world(_cuda_member, 2, args=(4, "nccl"), init_rpc=False, timeout=240)
    log = results[0]["log"]
    assert log == [(s, ("0", "1")) for s in range(4)]
    assert [r["devices"] for r in results] == [["cuda:0"], ["cuda:1"]]
    expected = replay(log)
    for r in results:
        for got, want in zip(r["params"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.gpu
@_TWO_GPUS
def test_a_member_killed_in_an_nccl_step_leaves_the_other_training_alone() -> None:
    """Member "1" dies inside step 2: member "0"'s NCCL reduction waits for a dead peer until the collective
    timeout, the group is aborted (not waited on), and step 2 is re-run by member "0" alone."""
    with pytest.raises(pd.RankDiedError) as info:
        pd.run_world(_cuda_member, 2, args=(5, "nccl", 2), init_rpc=False, timeout=240, grace_period=200)
    survivor = info.value.run_world_results[0]  # type: ignore[attr-defined]
    log = survivor["log"]
    assert log[:2] == [(0, ("0", "1")), (1, ("0", "1"))]
    assert log[2:] == [(s, ("0",)) for s in range(2, 5)]
    assert survivor["aborted"] >= 1
    expected = replay(log)
    for got, want in zip(survivor["params"], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
