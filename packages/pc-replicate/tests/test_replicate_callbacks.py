"""The replication-callback protocol: order, contexts, copy ids, shared submodules."""

from __future__ import annotations

import pytest
import torch
from replicate_testutils import assert_close
from torch import nn

from pc_replicate import (
    CallbackContext,
    ReplicationCallbackDataParallel,
    exec_data_parallel_replication_callback,
)


class Spy(nn.Module):
    """Records every callback as (name, copy_id, ctx) in a shared log."""

    def __init__(
        self, name: str, log: list[tuple[str, int, CallbackContext]], child: nn.Module | None = None
    ):
        super().__init__()
        self.name = name
        self.log = log
        self.lin = nn.Linear(3, 3)
        self.child = child

    def __data_parallel_replicate__(self, ctx: CallbackContext, copy_id: int) -> None:
        self.log.append((self.name, copy_id, ctx))
        self.copy_id = copy_id

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin(x)
        return self.child(x) if self.child is not None else x


class Plain(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _tree(log: list[tuple[str, int, CallbackContext]]) -> nn.Module:
    leaf = Spy("leaf", log)
    return Spy("root", log, nn.Sequential(Spy("mid", log, leaf), Plain()))


@pytest.mark.parametrize("n", [2, 3])
def test_callbacks_once_per_module_per_replica_copy0_first(n: int) -> None:
    log: list[tuple[str, int, CallbackContext]] = []
    module = _tree(log)
    dp = ReplicationCallbackDataParallel(module, device_ids=["cpu"] * n)
    replicas = dp.replicate(module, ["cpu"] * n)
    assert len(replicas) == n
    assert [(name, cid) for name, cid, _ in log] == [
        (name, cid) for cid in range(n) for name in ("root", "mid", "leaf")
    ]
    # one context per position, shared by the copies of that position, distinct across positions
    by_name: dict[str, set[int]] = {}
    for name, _, ctx in log:
        by_name.setdefault(name, set()).add(id(ctx))
    assert all(len(ids) == 1 for ids in by_name.values())
    assert len({next(iter(ids)) for ids in by_name.values()}) == 3
    # the callbacks ran on the replicas, never on the original
    assert not hasattr(module, "copy_id")
    assert [r.copy_id for r in replicas] == list(range(n))


def test_each_forward_gets_fresh_contexts_and_callbacks_precede_forward() -> None:
    events: list[str] = []

    class Ordered(nn.Module):
        def __data_parallel_replicate__(self, ctx: CallbackContext, copy_id: int) -> None:
            events.append(f"cb{copy_id}")
            ctx.seen = getattr(ctx, "seen", 0) + 1
            self.ctx = ctx

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            events.append("fwd")
            return x * 2

    dp = ReplicationCallbackDataParallel(Ordered(), device_ids=["cpu"] * 3)
    x = torch.randn(6, 2)
    assert_close(dp(x), x * 2)
    assert events[:3] == ["cb0", "cb1", "cb2"]
    assert events[3:] == ["fwd"] * 3
    first = dp.replicate(dp.module, ["cpu"] * 2)
    second = dp.replicate(dp.module, ["cpu"] * 2)
    assert first[0].ctx is first[1].ctx
    assert first[0].ctx is not second[0].ctx
    assert first[1].ctx.seen == 2


def test_shared_submodule_stays_shared_and_gets_one_position() -> None:
    log: list[tuple[str, int, CallbackContext]] = []
    shared = Spy("shared", log)
    module = nn.Sequential(shared, nn.ReLU(), shared)
    replicas = ReplicationCallbackDataParallel(module, ["cpu"] * 2).replicate(module, ["cpu"] * 2)
    assert [(name, cid) for name, cid, _ in log] == [("shared", 0), ("shared", 1)]
    for replica in replicas:
        assert replica[0] is replica[2]
        assert replica[0] is not shared
    x = torch.randn(4, 3)
    assert_close(ReplicationCallbackDataParallel(module, ["cpu"] * 2)(x), module(x))


def test_one_chunk_calls_only_copy0_and_one_device_calls_none() -> None:
    log: list[tuple[str, int, CallbackContext]] = []
    module = Spy("root", log)
    x = torch.randn(1, 3)
    assert_close(ReplicationCallbackDataParallel(module, ["cpu"] * 4)(x), module(x))
    assert [(name, cid) for name, cid, _ in log] == [("root", 0)]
    log.clear()
    assert ReplicationCallbackDataParallel(module, ["cpu"])(torch.randn(5, 3)).shape == (5, 3)
    assert log == []


def test_fewer_chunks_than_devices_replicates_onto_a_prefix() -> None:
    log: list[tuple[str, int, CallbackContext]] = []
    module = Spy("root", log)
    x = torch.randn(6, 3)
    assert_close(ReplicationCallbackDataParallel(module, ["cpu"] * 4)(x), module(x))
    assert [cid for _, cid, _ in log] == [0, 1, 2]


def test_exec_callback_directly_and_structure_mismatch() -> None:
    log: list[tuple[str, int, CallbackContext]] = []
    copies = [Spy("a", log), Spy("a", log)]
    exec_data_parallel_replication_callback(copies)
    assert [cid for _, cid, _ in log] == [0, 1]
    assert log[0][2] is log[1][2]
    exec_data_parallel_replication_callback([])  # nothing to do
    with pytest.raises(RuntimeError, match="replica 1"):
        exec_data_parallel_replication_callback([Spy("a", log), nn.Linear(2, 2)])
    with pytest.raises(TypeError, match="sequence"):
        exec_data_parallel_replication_callback(Spy("a", log))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"modules\[1\]"):
        exec_data_parallel_replication_callback([Spy("a", log), "nope"])  # type: ignore[list-item]


def test_callback_error_propagates_from_forward() -> None:
    class Bad(nn.Module):
        def __data_parallel_replicate__(self, ctx: CallbackContext, copy_id: int) -> None:
            if copy_id == 1:
                raise KeyError("copy 1 refuses")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(KeyError, match="copy 1 refuses"):
        ReplicationCallbackDataParallel(Bad(), ["cpu"] * 2)(torch.randn(4, 2))
