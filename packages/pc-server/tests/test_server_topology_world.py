"""Issue 14 over real RPC: the reported 3-process topology and a few generated ones, in one world.

Several servers share the world (spawning costs seconds). In the grid, reducer processes wait for the clients
on a condition fed by RPC notices; the reported pattern also runs with them parked in ``group.barrier()``.
"""

from __future__ import annotations

from typing import Any

import pytest
from server_grid import REGRESSION, check_case, generate_cases, grid_world, world_outcome
from server_parked import barrier_world

pc_distributed = pytest.importorskip("pc_distributed")

# primary '1' with secondaries among '2', '0' (inside and outside); clients anywhere, reducers included
CASES = generate_cases(seed=22, count=3, reducers=["1", "2", "0"], clients=["2", "0", "1"])


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return pc_distributed.run_world(
        grid_world, 3, args=(CASES,), timeout=170, rpc_timeout=20, dist_timeout=30
    )


def test_issue14_two_reducers_seven_pushes_all_applied(results: list[dict[str, Any]]) -> None:
    """The report: reducers '0' and '1' (primary '0'), client '2', 7 pushes of the same gradients, B=2, sum:
    the client's polling must see w0 - 7g (it saw w0 - 3g for good), with nothing booked as dropped."""
    seen = results[2]["regression"]
    assert seen["accepted"] == [True] * 7
    assert seen["polled"] == (1.0 - 42.0, 2.0 - 21.0, 3.0 - 14.0)
    mine = seen["ledger"].clients[seen["client_id"]]
    assert (mine.accepted, mine.applied, mine.dropped) == (7, 7, 0)
    assert results[0]["final"][REGRESSION.name] == (1.0 - 42.0, 2.0 - 21.0, 3.0 - 14.0)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_generated_topology_over_rpc(results: list[dict[str, Any]], case: Any) -> None:
    check_case(case, world_outcome(results, case))


def test_issue14_reducers_parked_in_a_barrier_lose_nothing() -> None:
    """The report's own pattern: the reducer processes wait in ``group.barrier()`` while the client pushes 7
    times and polls; every push must be applied, and the client's ledger query answers meanwhile."""
    results = pc_distributed.run_world(barrier_world, 3, timeout=170, rpc_timeout=20, dist_timeout=30)
    seen = results[2]["regression"]
    assert seen["accepted"] == [True] * 7
    assert seen["polled"] == (1.0 - 42.0, 2.0 - 21.0, 3.0 - 14.0)
    assert results[0]["final"] == (1.0 - 42.0, 2.0 - 21.0, 3.0 - 14.0)
    mine = seen["ledger"].clients[seen["client_id"]]
    assert (mine.accepted, mine.applied, mine.dropped) == (7, 7, 0)
