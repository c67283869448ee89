"""pc-server over pc-distributed: a worker killed mid-training; the others finish, the error is reported."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch import nn

import pc_distributed
import pc_server

STEPS = 12


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 1, bias=False)


def _train(rank: int) -> dict[str, float]:
    servers = pc_server.grad_server_helper(
        [_model],
        optimizer=torch.optim.SGD,
        learning_rate=0.1,
        timeout=60,
        server_kwargs={"reduce_method": "mean", "reduce_batch_size": 1},
    )
    (server,) = servers
    try:
        if rank == 1:
            model = _model()
            server.pull(model)
            nn.functional.mse_loss(model(torch.ones(2, 4)), torch.zeros(2, 1)).backward()
            server.push(model)
            os.kill(os.getpid(), signal.SIGKILL)  # dies mid-training, with its reducer service
        versions = []
        if rank == 2:
            model = _model()
            target = torch.ones(4)
            for _ in range(STEPS):
                server.pull(model)
                model.zero_grad(set_to_none=True)
                x = torch.randn(8, 4)
                nn.functional.mse_loss(model(x), (x @ target).unsqueeze(1)).backward()
                server.push(model)  # retries on another secondary if it picked the dead one
                versions.append(model.pp_version)
        done = pc_distributed.get_world().create_rpc_group("done", ["0", "2"])  # without rank 1, which died
        done.barrier(60)  # rank 2 has pushed every step (each push returns once queued, applied later)
        reached = servers.impls[0].wait_for_version(STEPS, 60) if rank == 0 else False
        done.barrier(60)  # the primary (rank 0) has applied them: a pull now sees every one
        if rank == 0:
            servers.watch()
            stats = servers.impls[0].stats()
            return {"steps": float(stats.steps), "applied": float(stats.applied), "reached": float(reached)}
        server.pull(model)
        return {"last_version": float(model.pp_version), "pushes": float(len(versions))}
    finally:
        servers.stop(timeout=10)


def test_worker_killed_mid_training_others_finish_and_error_is_reported() -> None:
    with pytest.raises(pc_distributed.RankDiedError, match="SIGKILL") as info:
        pc_distributed.run_world(_train, 3, timeout=180, grace_period=120, rpc_timeout=20)
    assert info.value.rank == 1
    survivors = info.value.run_world_results  # type: ignore[attr-defined]
    assert set(survivors) == {0, 2}, survivors
    assert survivors[2]["pushes"] == STEPS
    # Every push of the surviving worker (and the dead worker's single push, if it arrived) was applied.
    assert survivors[0]["applied"] >= STEPS
    assert survivors[0]["steps"] >= STEPS
    assert survivors[0]["reached"] == 1.0
    assert survivors[2]["last_version"] >= STEPS
