"""ElasticDataParallel with a CUDA module (skipped without CUDA; run by ``nox -s gpu``).

The members' groups are gloo's; a CUDA module's sums and the state handed to a joiner travel through host
memory. Two members share one GPU (gloo allows it), so one device is enough.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed_elastic_testutils import FAST, SAMPLER, X, Y, make_model, make_optimizer, params, replay

import pc_distributed as pd


def _cuda_member(rank: int, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    device = torch.device("cuda", 0)
    name = str(rank)
    model = make_model(name).to(device)
    x, y = X.to(device), Y.to(device)

    def compute(ctx: pd.StepContext) -> int:
        idx = SAMPLER.indices(ctx.step, ctx.members, ctx.member)
        torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        return len(idx)

    with pd.ElasticDataParallel(
        model, make_optimizer(model), name=name, job="gpu", initial_members=2, **FAST
    ) as edp:
        while edp.step < steps:
            edp.train_step(compute)
        return {
            "params": [t.cpu() for t in params(model)],
            "devices": sorted({str(t.device) for t in params(model)}),
            "log": [tuple(e) for e in edp.quorum_log],
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
