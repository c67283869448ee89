"""pc_sync.SyncBatchNorm across processes (gloo, CPU) and across replicas inside them, against torch on the
full batch in float64; plus the layer alone (no process group), its inputs and convert_sync_batchnorm.

Each world is started once and runs many checks (a world costs seconds to start); the ranks return their
largest differences and the collectives they counted, and the assertions run here.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from sync_world_workers import failing_world, grid_world, wrappers_world
from torch import nn

import pc_sync

pd = pytest.importorskip("pc_distributed")

TOL = 1e-10


def _start_method() -> str:
    # Forked ranks start fastest; CUDA cannot start in a child forked after the parent initialized it.
    return "spawn" if torch.cuda.is_available() else "fork"


def _world(fn: Any, size: int, *args: Any, **kwargs: Any) -> list[Any]:
    options: dict[str, Any] = {"timeout": 120, "dist_timeout": 20, "init_rpc": False}
    options.update(kwargs)
    return pd.run_world(fn, size, args=args, start_method=_start_method(), **options)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def grid() -> list[dict[str, Any]]:
    return _world(grid_world, 4)


LAYER_CASES = [
    "2d",
    "3d",
    "4d",
    "5d",
    "4d_channels_last",
    "affine_false",
    "no_running_stats",
    "even",
    "replicas",
]


@pytest.mark.parametrize("case", LAYER_CASES)
def test_matches_full_batch_on_every_rank(grid: list[dict[str, Any]], case: str) -> None:
    for rank, result in enumerate(grid):
        diff = result[case]["diff"]
        assert {"output", "input_grad"} <= set(diff), diff
        if case != "affine_false":
            assert {"weight_grad", "bias_grad"} <= set(diff), diff
        if case != "no_running_stats":
            assert {"running_mean", "running_var", "num_batches_tracked"} <= set(diff), diff
        bad = {k: v for k, v in diff.items() if not v <= TOL}
        assert not bad, f"rank {rank}, {case}: {bad}"


@pytest.mark.parametrize("case", LAYER_CASES)
def test_one_collective_per_layer_call_each_way_none_in_eval(grid: list[dict[str, Any]], case: str) -> None:
    for result in grid:
        *training, evaluation = result[case]["collectives"]
        # on CPU tensors the backward sum is an all_gather too (one gloo round where all_reduce takes two)
        assert training == [{"forward": {"all_gather": 1}, "backward": {"all_gather": 1}}] * len(training)
        assert not any(evaluation.values()), evaluation


def test_a_call_wider_than_any_before_widens_the_group_once(grid: list[dict[str, Any]]) -> None:
    for result in grid:
        assert result["widening"] == [{"all_gather": n} for n in (2, 1, 1, 2, 1, 1)]


def test_bfloat16_autocast_keeps_fp32_statistics_of_the_whole_batch(grid: list[dict[str, Any]]) -> None:
    for result in grid:
        obs = result["bfloat16"]
        assert obs["output_is_bf16"] == 0.0
        assert obs["stats_are_fp32"] == 0.0
        # bf16 statistics would be off by about 1e-2 here (mean 10); fp32 ones by about 1e-6
        assert obs["running_mean"] < 1e-5, obs
        assert obs["running_var"] < 1e-5, obs
        assert obs["output"] < 0.05, obs


def test_parameter_gradients_alone_make_no_backward_exchange(grid: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(grid):
        obs = result["parameter_grads_only"]
        assert obs["bias_is_none"]
        # the input needs no gradient, so backward has nothing to exchange: the forward's all_gather alone
        assert obs["collectives"] == {"all_gather": 1}
        bad = {k: v for k, v in obs["diff"].items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"


def test_one_member_group_is_a_plain_batch_norm(grid: list[dict[str, Any]]) -> None:
    for result in grid:
        obs = result["one_member"]
        assert obs["collectives"] == {}
        assert "is not a member of process_group" in obs["not_member"], obs["not_member"]
        assert obs["output"] <= TOL
        assert obs["running_var"] <= TOL


def test_backward_in_different_orders_raises_on_every_rank(grid: list[dict[str, Any]]) -> None:
    for result in grid:
        assert "backward in different orders" in result["crossed_backward"], result["crossed_backward"]
    for rank, result in enumerate(grid):  # the group works on afterwards
        bad = {k: v for k, v in result["after_crossed"]["diff"].items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"


def test_ranks_that_disagree_on_autograd_all_refuse(grid: list[dict[str, Any]]) -> None:
    for result in grid:
        assert "ranks [0]" in result["mixed_recording"], result["mixed_recording"]


# ------------------------------------------------------------------------------------- training wrappers
@pytest.fixture(scope="module")
def wrappers() -> list[dict[str, Any]]:
    # A torch optimizer's first construction imports torch._dynamo (seconds); do it once here, so that forked
    # ranks inherit it instead of each importing it again.
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    return _world(wrappers_world, 2)


@pytest.mark.parametrize(
    "how", ["ddp", "pc_data_parallel", "pc_data_parallel_deferred", "replicas_in_processes"]
)
def test_training_equals_full_batch_training(wrappers: list[dict[str, Any]], how: str) -> None:
    for rank, result in enumerate(wrappers):
        diff = result[how]
        assert {"1.running_var", "4.weight", "7.weight"} <= set(diff), sorted(diff)
        bad = {k: v for k, v in diff.items() if not v <= TOL}
        assert not bad, f"rank {rank}, {how}: {bad}"


def test_two_replicas_per_process_make_one_collective_per_layer(wrappers: list[dict[str, Any]]) -> None:
    for result in wrappers:
        # two SyncBatchNorm layers, two replicas each: still one collective per layer each way (on CPU tensors
        # both are all_gathers)
        assert result["replicas_collectives"] == [{"all_gather": 4}] * 3
        # DDP's gradient all-reduce goes through its reducer, not torch.distributed.all_reduce; the group's
        # first exchange (6 channels, the widest layer) widens its packets once, before sending them
        gathers = [c.get("all_gather") for c in result["ddp_collectives"]]
        assert gathers == [5, 4, 4], result["ddp_collectives"]


# ---------------------------------------------------------------------------------------------- failures
@pytest.mark.parametrize("mode", ["raise", "die"])
def test_a_failing_rank_gives_the_others_an_error_naming_it(mode: str) -> None:
    expected = RuntimeError if mode == "raise" else pd.RankDiedError
    with pytest.raises(expected) as info:
        _world(failing_world, 2, mode, dist_timeout=15, grace_period=60)
    if mode == "raise":
        assert "rank 1 failed before its batch norm" in str(info.value)
    else:
        assert info.value.rank == 1
    survivor = info.value.run_world_results[0]  # type: ignore[attr-defined]
    assert survivor["type"] in ("ConnectionError", "TimeoutError"), survivor
    assert "rank(s) [1]" in survivor["message"], survivor
    assert "on rank 0" in survivor["message"], survivor


def test_a_stalled_rank_gives_the_others_a_timeout_naming_it() -> None:
    # rank 1 stays alive but away from the layer past the group's 5 s timeout, until rank 0 releases it
    survivor, stalled = _world(failing_world, 2, "stall", dist_timeout=5)
    assert stalled["type"] == "released"
    assert survivor["type"] == "TimeoutError", survivor
    assert "rank(s) [1]" in survivor["message"], survivor


# ------------------------------------------------------------------------------------ no process group
def test_constructor_is_torchs() -> None:
    ours = inspect.signature(pc_sync.SyncBatchNorm).parameters
    theirs = inspect.signature(nn.SyncBatchNorm).parameters
    positional = [n for n, p in theirs.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [n for n, p in ours.items() if p.kind is p.POSITIONAL_OR_KEYWORD] == positional
    for name in positional:
        assert ours[name].default == theirs[name].default, name
    bn = pc_sync.SyncBatchNorm(4, 1e-3, 0.2, True, False, None, "cpu", torch.float64)
    assert (bn.eps, bn.momentum, bn.track_running_stats, bn.process_group) == (1e-3, 0.2, False, None)
    assert bn.weight.dtype == torch.float64
    assert isinstance(bn, nn.modules.batchnorm._BatchNorm)
    assert pc_sync.SyncBatchNorm(4).state_dict().keys() == nn.SyncBatchNorm(4).state_dict().keys()


@pytest.mark.parametrize("shape", [(6, 3), (6, 3, 4), (6, 3, 4, 2), (6, 3, 2, 2, 2)])
def test_without_a_process_group_it_is_a_plain_batch_norm(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(3)
    ref = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[len(shape)](3).double()
    ours = pc_sync.SyncBatchNorm(3, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-1, 1)
    ours.load_state_dict(ref.state_dict())
    for training in (True, True, False):
        ref.train(training)
        ours.train(training)
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)
    torch.testing.assert_close(ours.running_var, ref.running_var, rtol=0, atol=0)


def test_replicas_in_one_process_match_the_replica_classes() -> None:
    from pc_replicate import ReplicationCallbackDataParallel

    gen = torch.Generator().manual_seed(4)
    ours = pc_sync.SyncBatchNorm(3, dtype=torch.float64)
    ref = nn.BatchNorm2d(3, dtype=torch.float64)
    x = torch.randn(9, 3, 2, 2, generator=gen, dtype=torch.float64) + 4
    g = torch.randn(9, 3, 2, 2, generator=gen, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = ReplicationCallbackDataParallel(ours, device_ids=["cpu"] * 3)(xa)
    (y * g).sum().backward()
    y_ref = ref(xb)
    (y_ref * g).sum().backward()
    for a, b in [
        (y, y_ref),
        (xa.grad, xb.grad),
        (ours.weight.grad, ref.weight.grad),
        (ours.running_var, ref.running_var),
    ]:
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [
        (torch.zeros(4), ValueError, "1-D input"),
        (torch.zeros(2, 3, 1, 1, 1, 1), ValueError, "6-D input"),
        (torch.zeros(2, 5, 3), ValueError, "expects 3 channels"),
        ([[1.0, 2.0, 3.0]], TypeError, "torch.Tensor"),
    ],
)
def test_bad_inputs_name_the_problem(value: Any, error: type[Exception], words: str) -> None:
    bn = pc_sync.SyncBatchNorm(3)
    for training in (True, False):
        bn.train(training)
        with pytest.raises(error, match=words):
            bn(value)


def test_bad_num_features() -> None:
    with pytest.raises(ValueError, match="num_features"):
        pc_sync.SyncBatchNorm(0)


def test_convert_sync_batchnorm_takes_over_the_same_tensors() -> None:
    inner = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, momentum=None), nn.ReLU())
    model = nn.Sequential(
        inner,
        nn.BatchNorm1d(4, affine=False, track_running_stats=False).eval(),
        nn.SyncBatchNorm(4, eps=1e-3),
        pc_sync.SynchronizedBatchNorm3d(4, sync_timeout=7.0),
    )
    old = [inner[1], model[1], model[2], model[3]]
    tensors = [[*m.parameters(), *m.buffers()] for m in old]
    group = object()  # carried along as given, as torch does
    out = pc_sync.convert_sync_batchnorm(model, process_group=group)
    assert out is model
    assert out[0] is inner
    assert isinstance(inner[0], nn.Conv2d)
    new = [inner[1], model[1], model[2], model[3]]
    for before, after, same in zip(old, new, tensors, strict=True):
        assert type(after) is pc_sync.SyncBatchNorm
        assert after.process_group is group
        assert [*after.parameters(), *after.buffers()] == same
        assert all(a is b for a, b in zip([*after.parameters(), *after.buffers()], same, strict=True))
        for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats", "training"):
            assert getattr(after, attr) == getattr(before, attr), attr
    assert new[3].sync_timeout == 7.0
    top = pc_sync.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm2d(2))
    assert type(top) is pc_sync.SyncBatchNorm
    with pytest.raises(ValueError, match="uninitialized"):
        pc_sync.convert_sync_batchnorm(nn.Sequential(nn.LazyBatchNorm2d()))
    with pytest.raises(TypeError, match=r"nn\.Module"):
        pc_sync.convert_sync_batchnorm("model")  # type: ignore[arg-type]
