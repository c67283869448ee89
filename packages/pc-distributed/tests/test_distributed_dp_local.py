"""In-process checks of the data-parallel pieces that need no world: buckets, optimizer, argument errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pc_distributed.parallel._buckets import make_buckets
from pc_distributed.parallel._comm import resolve_group, to_timedelta
from pc_distributed.parallel.data_parallel import DataParallel
from pc_distributed.parallel.optimizer import DataParallelOptimizer


def test_dp_buckets_split_by_dtype_and_cap_in_order() -> None:
    a = nn.Parameter(torch.zeros(10))  # 40 bytes
    b = nn.Parameter(torch.zeros(10))
    c = nn.Parameter(torch.zeros(10, dtype=torch.float64))
    d = nn.Parameter(torch.zeros(3))
    buckets = make_buckets([[a, b, c, d]], cap_bytes=60)
    assert [[id(p) for p in bk.params] for bk in buckets] == [[id(a)], [id(b)], [id(c)], [id(d)]]
    buckets = make_buckets([[a, b], [d]], cap_bytes=None)
    assert [len(bk.params) for bk in buckets] == [2, 1]
    assert buckets[0].numel == 20
    assert buckets[0].offsets == [0, 10]
    assert buckets[0].flat.numel() == 22  # payload + one "used" counter per parameter
    # a small first bucket closes once it reaches its cap (b crosses it); the rest fill up to cap_bytes
    buckets = make_buckets([[a, b, d, a]], cap_bytes=1000, first_cap_bytes=50)
    assert [[id(p) for p in bk.params] for bk in buckets] == [[id(a), id(b)], [id(d), id(a)]]


def test_dp_optimizer_checks_types_and_steps_without_owner() -> None:
    p = nn.Parameter(torch.ones(2))
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        DataParallelOptimizer("sgd")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="blocking must be a bool"):
        DataParallelOptimizer(torch.optim.SGD([p], lr=1.0), blocking=1)  # type: ignore[arg-type]
    opt = DataParallelOptimizer(torch.optim.SGD([p], lr=1.0))
    p.grad = torch.ones(2)
    opt.step()  # not attached to a DataParallel: a plain step
    assert torch.equal(p.detach(), torch.zeros(2))
    opt.zero_grad()
    assert p.grad is None
    assert opt.param_groups[0]["lr"] == 1.0
    assert "non-blocking" in repr(opt)


def test_dp_requires_initialised_torch_distributed() -> None:
    net = nn.Linear(2, 2)
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="not initialised"):
        DataParallel(net, optimizer=opt)
    with pytest.raises(RuntimeError, match="not initialised"):
        resolve_group(None)


def test_dp_local_argument_errors_come_before_any_communication() -> None:
    net = nn.Linear(2, 2)
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="got None"):
        DataParallel(net)
    with pytest.raises(TypeError, match="empty"):
        DataParallel(net, optimizer=[])
    with pytest.raises(TypeError, match="blocking_parameter_updates must be a bool"):
        DataParallel(net, optimizer=opt, blocking_parameter_updates="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DataParallel(net, optimizer=opt, bucket_cap_mb=0)
    with pytest.raises(ValueError, match="first_bucket_cap_mb"):
        DataParallel(net, optimizer=opt, first_bucket_cap_mb=-1.0)
    with pytest.raises(ValueError, match="timeout"):
        DataParallel(net, optimizer=opt, timeout=0)
    with pytest.raises(ValueError, match="timeout"):
        DataParallel(net, optimizer=opt, timeout=-2.0)
    with pytest.raises(TypeError, match="timeout"):
        DataParallel(net, optimizer=opt, timeout="60")  # type: ignore[arg-type]


def test_dp_timeout_conversion() -> None:
    assert to_timedelta(None) is None
    td = to_timedelta(1.5)
    assert td is not None
    assert td.total_seconds() == 1.5
