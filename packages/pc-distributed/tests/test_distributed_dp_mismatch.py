"""Ranks that would reach DataParallel's or DASO's collectives by different paths: a ValueError on each.

Each case runs in a 2-process gloo world. Settings that decide which collectives a rank issues and how many
bytes each carries differ between the ranks: the mode, the bucket plan, the buffer broadcast, DASO's
schedule and exchange format. Unchecked, these abort a process inside gloo ("Received data size doesn't
match"), time out, or sum unlike tensors into replicas that silently drift apart. A rank whose backward
reaches no parameter still takes part in the step's reduction, with zeros.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed_testutils import fork_unless_cuda
from torch import nn

import pc_distributed as pd
from pc_distributed.parallel.daso.daso import DASO
from pc_distributed.parallel.daso.multigpu import DataParallelMultiGPU
from pc_distributed.parallel.data_parallel import DataParallel
from pc_distributed.parallel.optimizer import DataParallelOptimizer

pytestmark = pytest.mark.backends_inside


def _outcome(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _group_still_works() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def _dp_case(rank: int, case: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net: nn.Module = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    params: list[nn.Parameter] = list(net.parameters())
    kwargs: dict[str, Any] = {"blocking_parameter_updates": True}
    if case == "mode":  # one Linear: both plans carry 12 numbers, in another order
        net = nn.Linear(3, 3)
        params = list(net.parameters())
        kwargs = {"blocking_parameter_updates": rank == 0}
    elif case == "fallback":  # non-blocking asked on both; rank 1's optimizer makes it fall back
        net = nn.Linear(3, 3)
        params = list(net.parameters()) if rank == 0 else [net.weight]
        kwargs = {}
    elif case == "bucket_cap":
        cap = 25.0 if rank == 0 else 1e-5
        kwargs.update(bucket_cap_mb=cap, first_bucket_cap_mb=cap)
    elif case == "broadcast_buffers":
        net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
        params = list(net.parameters())
        kwargs.update(broadcast_buffers=rank == 0)
    opt = DataParallelOptimizer(torch.optim.SGD(params, lr=0.1))

    def train() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fallback's warning
            dp = DataParallel(net, optimizer=opt, **kwargs)
        for _ in range(2):
            opt.zero_grad()
            dp(torch.full((4, 3), float(rank + 1))).sum().backward()
            opt.step()
        dp.flush()

    return {"outcome": _outcome(train), "after": _group_still_works()}


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("mode", "the mode (blocking_parameter_updates after any fallback to blocking) differs across "
         "ranks: [True, False] by group rank"),
        ("fallback", "the mode (blocking_parameter_updates after any fallback to blocking) differs across "
         "ranks: [False, True] by group rank"),
        ("bucket_cap", "the gradient bucket plan (bucket_cap_mb, first_bucket_cap_mb) differs on group "
         "rank(s) [1] from group rank 0"),
        ("broadcast_buffers", "broadcast_buffers differs across ranks: [True, False] by group rank"),
    ],
)  # fmt: skip
def test_dp_settings_that_differ_are_a_value_error_on_every_rank(case: str, message: str) -> None:
    results = pd.run_world(
        _dp_case,
        2,
        args=(case,),
        init_rpc=False,
        timeout=120,
        dist_timeout=30,
        start_method=fork_unless_cuda(),
    )
    for rank, result in enumerate(results):
        assert (
            result["outcome"] == f"ValueError: DataParallel: {message}; it must be the same on every rank"
        ), rank
        assert result["after"] == 2.0  # nothing was sent: the group's next collective pairs up


def _no_grad_rank(rank: int, blocking: bool) -> list[list[float]]:
    """Rank 1's loss does not depend on the model (as for an empty batch): it takes part with zeros."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    dp = DataParallel(net, optimizer=opt, blocking_parameter_updates=blocking, timeout=30)
    for step in range(3):
        opt.zero_grad()
        out = dp(torch.full((4, 3), float(step + 1)))
        loss = out.pow(2).sum() if rank == 0 else torch.zeros((), requires_grad=True)
        loss.backward()
        opt.step()
    dp.flush()
    return [p.detach().reshape(-1).tolist() for p in net.parameters()]


@pytest.mark.parametrize("blocking", [True, False])
def test_dp_a_rank_whose_backward_reaches_no_parameter_contributes_zeros(blocking: bool) -> None:
    results = pd.run_world(
        _no_grad_rank,
        2,
        args=(blocking,),
        init_rpc=False,
        timeout=120,
        dist_timeout=30,
        start_method=fork_unless_cuda(),
    )
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(3):  # the average of rank 0's gradient and rank 1's zeros
        opt.zero_grad()
        (net(torch.full((4, 3), float(step + 1))).pow(2).sum() / 2).backward()
        opt.step()
    expected = [p.detach().reshape(-1) for p in net.parameters()]
    assert results[0] == results[1]
    for got, want in zip(results[0], expected, strict=True):
        assert torch.allclose(torch.tensor(got), want, atol=1e-6), (got, want)


def _daso_case(rank: int, case: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    kwargs: dict[str, Any] = {
        "total_epochs": 4,
        "warmup_epochs": 1,
        "cooldown_epochs": 1,
        "max_global_skips": 2,
        "local_size": 1,
        "timeout": 30,
    }
    last_batch = 3
    if case == "last_batch":  # uneven shards: rank 1's loader has one batch more
        last_batch += rank
    elif case == "warmup_epochs":
        kwargs["warmup_epochs"] = 1 + rank
    elif case == "sending_chunk_size":
        kwargs["sending_chunk_size"] = 10 - 3 * rank
    elif case == "downcast_type":
        kwargs["downcast_type"] = torch.bfloat16 if rank == 0 else torch.float

    def train() -> None:
        daso = DASO(torch.optim.SGD(model.parameters(), lr=0.05), **kwargs)
        dpm = DataParallelMultiGPU(model, daso)
        for _epoch in range(3):
            daso.last_batch = last_batch
            for _ in range(last_batch + 1):
                daso.zero_grad()
                dpm(torch.randn(4, 4)).pow(2).mean().backward()
                daso.step()
            daso.epoch_loss_logic(1.0)

    return {"outcome": _outcome(train), "after": _group_still_works()}


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("last_batch", "last_batch differs across ranks: [3, 4] by group rank"),
        ("warmup_epochs", "warmup_epochs differs across ranks: [1, 2] by group rank"),
        ("sending_chunk_size", "sending_chunk_size differs across ranks: [10, 7] by group rank"),
        ("downcast_type", "downcast_type differs on group rank(s) [1] from group rank 0"),
    ],
)
def test_daso_settings_and_schedules_that_differ_are_a_value_error_on_every_rank(
    case: str, message: str
) -> None:
    results = pd.run_world(
        _daso_case,
        2,
        args=(case,),
        init_rpc=False,
        timeout=120,
        dist_timeout=30,
        start_method=fork_unless_cuda(),
    )
    for rank, result in enumerate(results):
        assert result["outcome"] == f"ValueError: DASO: {message}; it must be the same on every rank", rank
        assert result["after"] == 2.0
