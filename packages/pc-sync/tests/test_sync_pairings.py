"""Processes that reach one SyncBatchNorm exchange by different paths (gloo, CPU, two real processes).

One replica (a batch of one row under the wrapper), several replicas, no wrapper, an empty batch: every
pairing must train exactly as torch's batch norm on the full batch (float64: outputs, input and parameter
gradients, running statistics), and ranks whose layers differ (channels, dtype) must each get a ValueError
naming the difference, with no process aborted and the group usable afterwards.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sync_pairing_workers import (
    PAIRINGS,
    fused_grid_world,
    fused_pairings_world,
    mismatch_world,
    pairings_world,
)

pd = pytest.importorskip("pc_distributed")
pytest.importorskip("pc_replicate")

TOL = 1e-10


def _world(fn: Any) -> list[Any]:
    start = "spawn" if torch.cuda.is_available() else "fork"
    return pd.run_world(  # type: ignore[no-any-return]
        fn, 2, start_method=start, timeout=180, dist_timeout=30, init_rpc=False
    )


@pytest.fixture(scope="module")
def pairings() -> list[dict[str, Any]]:
    return _world(pairings_world)


@pytest.fixture(scope="module")
def mismatches() -> list[dict[str, Any]]:
    # a rank that aborts (as gloo does on packets of different sizes) fails run_world with RankDiedError
    return _world(mismatch_world)


@pytest.mark.parametrize("pairing", list(PAIRINGS))
@pytest.mark.parametrize("shape", ["4d", "2d"])
def test_every_pairing_of_paths_trains_as_the_full_batch(
    pairings: list[dict[str, Any]], pairing: str, shape: str
) -> None:
    for rank, result in enumerate(pairings):
        diff = result[pairing][shape]["diff"]
        expected = {"output", "input_grad", "weight_grad", "bias_grad", "running_mean", "running_var"}
        assert expected <= set(diff), diff
        bad = {k: v for k, v in diff.items() if not v <= TOL}
        assert not bad, f"rank {rank}, {pairing}, {shape}: {bad}"


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("channels_3_and_4", ["different channel counts", "rank 0: 3 channels", "rank 1: 4 channels"]),
        ("channels_3_and_400", ["different channel counts", "rank 1: 400 channels"]),
        ("channels_5_and_6_replicas", ["rank 0: 5 channels", "rank 1: 6 channels, float32, 2 replica(s)"]),
        ("channels_6_and_12", ["rank 0: 6 channels", "rank 1: 12 channels"]),
        ("dtypes", ["different input dtypes", "rank 0: 3 channels, float32", "rank 1: 3 channels, float64"]),
        ("dtypes_replicas", ["different input dtypes", "float32, 2 replica(s)", "float64, no replicas"]),
    ],
)
def test_ranks_whose_layers_differ_all_get_a_value_error(
    mismatches: list[dict[str, Any]], case: str, words: list[str]
) -> None:
    messages = [result[case] for result in mismatches]
    assert messages[0] == messages[1], messages  # the same table, the same verdict on every rank
    for word in ["ValueError", *words]:
        assert word in messages[0], messages[0]


def test_the_group_works_after_a_mismatch(mismatches: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(mismatches):
        assert result["matching_8"] == "no error"
        bad = {k: v for k, v in result["after"]["diff"].items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"


# ------------------------------------------------------------------------------ the fused path (stand-ins)
@pytest.fixture(scope="module")
def fused_pairings() -> list[dict[str, Any]]:
    return _world(fused_pairings_world)


@pytest.fixture(scope="module")
def fused_grid() -> list[dict[str, Any]]:
    start = "spawn" if torch.cuda.is_available() else "fork"
    return pd.run_world(  # type: ignore[no-any-return]
        fused_grid_world, 4, start_method=start, timeout=180, dist_timeout=30, init_rpc=False
    )


def _check(result: dict[str, Any], what: str) -> None:
    diff = result["diff"]
    assert {"output", "input_grad"} <= set(diff), diff
    bad = {k: v for k, v in diff.items() if not v <= TOL}
    assert not bad, f"{what}: {bad}"


@pytest.mark.parametrize("pairing", list(PAIRINGS))
def test_every_pairing_on_the_fused_kernels_trains_as_the_full_batch(
    fused_pairings: list[dict[str, Any]], pairing: str
) -> None:
    paths = PAIRINGS[pairing]
    for rank, result in enumerate(fused_pairings):
        _check(result[pairing], f"rank {rank}, {pairing}")
        if paths[rank][1] > 0:  # a rank with values ran the kernels in both training steps
            calls = result[pairing]["kernel_calls"]
            assert calls["batch_norm_stats"] >= 2, calls
            assert calls["batch_norm_backward_elemt"] == calls["batch_norm_stats"], calls


@pytest.mark.parametrize("pairing", list(PAIRINGS))
def test_a_fused_rank_beside_a_composite_rank_trains_as_the_full_batch(
    fused_pairings: list[dict[str, Any]], pairing: str
) -> None:
    for rank, result in enumerate(fused_pairings):
        _check(result[f"{pairing}_mixed"], f"rank {rank}, {pairing}")
    fused_ranks = [r for r, result in enumerate(fused_pairings) if result[f"{pairing}_mixed"]["kernel_calls"]]
    assert len(fused_ranks) == 1  # one rank on each path


@pytest.mark.parametrize(
    "case",
    [
        "2d",
        "3d",
        "4d",
        "5d",
        "4d_channels_last",
        "affine_false",
        "no_running_stats",
        "bias_false",
        "replicas",
    ],
)
def test_fused_grid_of_four_ranks_with_an_empty_one(fused_grid: list[dict[str, Any]], case: str) -> None:
    for rank, result in enumerate(fused_grid):
        _check(result[case], f"rank {rank}, {case}")
        if case != "replicas" and rank != 1:  # rank 1's batch is empty: no kernel sees it
            assert result[case]["kernel_calls"]["batch_norm_stats"] == 2, result[case]["kernel_calls"]
        if case != "no_running_stats":
            assert {"running_mean", "running_var", "num_batches_tracked"} <= set(result[case]["diff"])


def test_fused_fp16_input_keeps_fp32_statistics_of_the_whole_batch(fused_grid: list[dict[str, Any]]) -> None:
    for result in fused_grid:
        obs = result["float16"]
        assert obs["output_is_fp16"] == obs["grad_is_fp16"] == obs["stats_are_fp32"] == 0.0, obs
        assert obs["gather_calls"] == 1.0, obs
        # fp16 statistics would be off by about 1e-2 here (mean 10); fp32 ones by about 1e-5
        assert obs["running_mean"] < 1e-4, obs
        assert obs["running_var"] < 1e-4, obs
        assert obs["output"] < 1e-2, obs
