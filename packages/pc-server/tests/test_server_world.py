"""pc-server over real RPC: one 3-process world runs every happy-path check (spawning costs seconds)."""

from __future__ import annotations

from typing import Any

import pytest
from server_world_checks import happy_world

pc_distributed = pytest.importorskip("pc_distributed")


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return pc_distributed.run_world(happy_world, 3, timeout=170, rpc_timeout=20, dist_timeout=30)


def test_model_server_ten_pushes_one_rpc_each(results: list[dict[str, Any]]) -> None:
    assert results[1]["push_counts"] == [(True, 1)] * 9
    assert results[1]["pp_version"] == 10
    assert results[2]["pulled"] == (11.0, 12.0, 13.0)


def test_model_server_up_to_date_pull_and_stale_push(results: list[dict[str, Any]]) -> None:
    assert results[2]["uptodate_pull_calls"] == 1
    assert results[2]["stale_push"] is False
    assert results[2]["stale_push_calls"] == 1
    assert results[2]["stale_adopted"] == ((11.0, 12.0, 13.0), 10)


def test_model_server_large_tensors_are_snapshots(results: list[dict[str, Any]]) -> None:
    assert results[1]["big_push"] is True
    assert results[2]["big_pulled"] == (True, 1, [[1.0], [1.0], [1.0]])
    assert results[2]["big_repulled"] == [[1.0], [1.0], [1.0]]
    assert results[0]["big_self_push"] is True
    assert results[0]["big_self_pulled"] == (2, [[3.0], [3.0], [3.0]], True)
    assert results[0]["big_stored"] == (2, [3.0])
    assert results[0]["big_self_calls"] == 0  # the server's own process calls it directly


def test_ordered_server_cas_one_winner_and_snapshots(results: list[dict[str, Any]]) -> None:
    wins = [results[1]["cas_win"], results[2]["cas_win"]]
    assert wins.count(True) == 1
    winner = 1 if wins[0] else 2
    assert results[0]["cas_head"] == ([float(winner)] * 2, 1)
    assert results[0]["self_snapshot"] == ([8.0, 8.0], [1.0, 1.0])
    assert results[0]["self_kv_calls"] == 0


def test_grad_server_client_in_the_reducers_process_calls_them_directly(
    results: list[dict[str, Any]],
) -> None:
    local = results[0]["local_grad_push"]
    assert local["accepted"] == [True, True]
    assert local["calls"] == 0  # neither the pushes nor the pulls went through RPC
    assert local["steps"] == 1
    assert local["weights"] == [[-3.0], [-3.0]]  # the gradients as pushed, not as mutated afterwards
    assert local["ledger"] == (2, 2)


@pytest.mark.parametrize(("method", "expected"), [("sum", (-23.0, -10.0, -5.0)), ("mean", (-5.0, -1.0, 1.0))])
def test_grad_server_machin_example(results: list[dict[str, Any]], method: str, expected: tuple) -> None:
    assert results[0][f"gs_{method}_reached"] is True
    assert results[1][f"gs_{method}"] == expected
    assert results[2][f"gs_{method}"] == expected


def test_grad_server_helper_no_stranded_gradients(results: list[dict[str, Any]]) -> None:
    routes = results[1]["helper_routes"] + results[2]["helper_routes"]
    assert len(set(routes)) >= 2  # pushes went to several secondaries
    assert results[0]["helper_applied"] == 6  # every push reached the model
    steps = results[0]["helper_steps"]
    assert steps >= 1
    assert results[0]["helper_lr"] == pytest.approx(0.5 * 0.5**steps)  # StepLR stepped with every step
    assert results[0]["helper_identity"] is True
    assert sum(r["received"] for r in results) == 6
