"""DataParallel on 2-process gloo worlds: numerics against single-process SGD, buffers, errors, peer death."""

from __future__ import annotations

from pathlib import Path

import distributed_dp_testutils as tu
import pytest

from pc_distributed import run_world
from pc_distributed._errors import RankDiedError


@pytest.fixture(scope="module")
def numerics() -> list[dict]:
    # One world runs every numeric check (a spawn costs seconds); asserts inside the workers compare each rank
    # against the single-process full-batch oracle.
    return run_world(tu.dp_numerics_worker, 2, init_rpc=False, timeout=170, dist_timeout=30)


@pytest.mark.parametrize(
    "mode",
    [
        "blocking64",
        "nonblocking64",
        "blocking32",
        "accumulate_blocking",
        "accumulate_nonblocking",
        "blocking64_small_buckets",
        "accumulate_blocking_small_buckets",
    ],
)
def test_dp_matches_single_process_sgd_and_ranks_agree(numerics: list[dict], mode: str) -> None:
    r0, r1 = numerics[0][mode], numerics[1][mode]
    bound = 1e-6 if mode == "blocking32" else 1e-10
    assert r0["err"] < bound
    assert r1["err"] < bound
    assert r0["params"] == r1["params"], "ranks hold different parameters"


def test_dp_blocking_all_reduce_overlaps_backward(numerics: list[dict]) -> None:
    # event order, not time: the last layer's bucket (2 params: 20 values + 2 "used" counters) is launched
    # before backward reaches the first layer, whose bucket follows; all before backward returns
    for events in (numerics[0]["overlap"], numerics[1]["overlap"]):
        assert events == [
            "all_reduce 22",
            "backward reaches layer 0",
            "all_reduce 22",
            "backward returned",
        ], events


def test_dp_buffers_follow_rank0_after_eval(numerics: list[dict]) -> None:
    b0, b1 = numerics[0]["buffers"], numerics[1]["buffers"]
    assert b0["before"] != b1["before"], "the data should make the local statistics differ"
    assert b0["after"] == b1["after"] == b0["before"]
    assert b0["count"] == b1["count"] == 2


def test_dp_rank_dependent_unused_branch_does_not_hang(numerics: list[dict]) -> None:
    r0, r1 = numerics[0]["branch"], numerics[1]["branch"]
    assert r0["b_weight"] == r1["b_weight"]
    assert r0["a_weight"] == r1["a_weight"]


def test_dp_bad_input_raises_on_every_rank(numerics: list[dict]) -> None:
    # the worker asserted each error on each rank; the group still worked afterwards
    assert [r["errors"]["sum"] for r in numerics] == [2.0, 2.0]


def test_dp_peer_death_raises_instead_of_hanging(tmp_path: Path) -> None:
    report = tmp_path / "survivor.txt"
    # RankDiedError, not run_world's TimeoutError: the survivor's report proves it got past the reduction.
    with pytest.raises(RankDiedError):
        run_world(
            tu.dp_peer_death_worker, 2, args=(str(report),), init_rpc=False, timeout=90, dist_timeout=20
        )
    assert report.exists(), "the surviving rank did not get past the failed reduction"
    assert report.read_text() != "no error"
