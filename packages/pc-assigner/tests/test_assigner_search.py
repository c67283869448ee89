"""Local search priced with numpy, run starts, the hub lower bound (against brute force, stored optima)."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import random

import pytest
from assigner_testutils import brute_force, random_problem

from pc_assigner import PlacementProblem, solve_placement
from pc_assigner._core import Compiled, compile_problem
from pc_assigner._heuristic import first_feasible, local_search, segments
from pc_assigner._local import VECTOR_MIN_N, vector_local_search

OPTIMA = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "optima"


def _with_hubs(p: PlacementProblem, rng: random.Random) -> PlacementProblem:
    """``p`` plus actor-critic traffic: item 0 feeds every item, every item feeds the last."""
    traffic = {(i, k): w for i, k, w in p.traffic}
    for i in range(1, p.n - 1):
        traffic[(0, i)] = traffic.get((0, i), 0.0) + rng.lognormvariate(-0.5, 1)
        traffic[(i, p.n - 1)] = traffic.get((i, p.n - 1), 0.0) + rng.lognormvariate(-0.5, 1)
    return dataclasses.replace(p, traffic=traffic)


def _improving_step(c: Compiled, a: list[int]) -> tuple[int, ...] | None:
    """A feasible move or swap that lowers the cost by more than rounding, or ``None`` (a local optimum)."""
    cost = c.cost(a)
    for i in range(c.n):
        for j in range(c.m):
            b = list(a)
            b[i] = j
            if c.feasible(b) and c.cost(b) < cost - 1e-9 * abs(cost):
                return (i, j)
        for k in range(i + 1, c.n):
            b = list(a)
            b[i], b[k] = a[k], a[i]
            if c.feasible(b) and c.cost(b) < cost - 1e-9 * abs(cost):
                return (i, k, -1)
    return None


def test_vector_local_search_ends_in_a_local_optimum_like_the_python_loop() -> None:
    rng = random.Random(31)
    same = 0
    for trial in range(12):
        p = random_problem(
            rng, rng.randint(12, 30), rng.randint(2, 4), rng.choice([1.2, 1.5]), rng.random() < 0.5
        )
        if trial % 2:
            p = _with_hubs(p, rng)
        c = compile_problem(p)
        start = first_feasible(c)
        assert start is not None
        found = vector_local_search(c, start)
        assert c.feasible(found)
        assert c.cost(found) <= c.cost(start) * (1 + 1e-12)
        assert _improving_step(c, found) is None, trial
        assert vector_local_search(c, start) == found  # deterministic
        assert c.n < VECTOR_MIN_N  # so local_search below is the pure-Python loop
        same += local_search(c, start) == found
    assert same >= 10  # the same steps in the same order: they part only at an exact tie


def test_local_search_switches_to_numpy_from_vector_min_n() -> None:
    p = random_problem(random.Random(4), VECTOR_MIN_N, 4, 1.2)
    c = compile_problem(p)
    start = first_feasible(c)
    assert start is not None
    with pytest.MonkeyPatch.context() as mp:
        calls: list[int] = []
        mp.setattr("pc_assigner._heuristic.vector_local_search", lambda c, a: calls.append(c.n) or list(a))
        assert local_search(c, start) == start
    assert calls == [VECTOR_MIN_N]


def test_segments_cut_an_order_into_balanced_runs() -> None:
    p = PlacementProblem(
        sizes=(1,) * 12,
        compute=(1,) * 12,
        capacities=(10, 10, 10),
        speeds=(1, 1, 2),
        distance=((0, 1, 1), (1, 0, 1), (1, 1, 0)),
        traffic={(i, i + 1): 1.0 for i in range(11)},
    )
    c = compile_problem(p)
    # level 12 / (1 + 1 + 2) = 3: three items on each unit device, six on the fast one
    assert segments(c, list(range(12))) == [0] * 3 + [1] * 3 + [2] * 6
    assert segments(c, list(range(11, -1, -1))) == [2] * 6 + [1] * 3 + [0] * 3
    tight = dataclasses.replace(p, capacities=(2, 2, 2))
    assert segments(compile_problem(tight), list(range(12))) is None  # the runs overflow the last device


def test_large_chain_placement_cuts_few_edges() -> None:
    """n = 120 (numpy local search): the run start keeps a chain's traffic to a few cut edges."""
    rng = random.Random(8)
    n = 120
    p = PlacementProblem(
        sizes=(1.0,) * n,
        compute=tuple(rng.uniform(0.5, 1.5) for _ in range(n)),
        capacities=(n / 2,) * 4,
        speeds=(1,) * 4,
        distance=tuple(tuple(0.0 if a == b else 0.1 for b in range(4)) for a in range(4)),
        traffic={(i, i + 1): 1.0 for i in range(n - 1)},
    )
    r = solve_placement(p)
    balanced = sum(p.compute) / 4
    assert r.cost.makespan <= balanced * 1.02
    assert r.cost.communication <= 0.1 * 12  # at most a dozen of the 119 edges cut
    assert solve_placement(p) == r


def test_hub_bound_is_a_lower_bound_against_brute_force() -> None:
    pytest.importorskip("scipy")
    from pc_assigner._bound import hub_lower_bound
    from pc_assigner._ilp import lp_lower_bound

    rng = random.Random(17)
    raised = 0
    for trial in range(16):
        p = random_problem(
            rng, rng.randint(3, 6), rng.randint(2, 3), rng.choice([0.9, 1.2]), rng.random() < 0.5
        )
        if trial % 2:
            p = _with_hubs(p, rng)
        ref = brute_force(p)
        if ref is None:
            continue
        c = compile_problem(p)
        lp = lp_lower_bound(c)
        for hubs in (0, 1, 2, 3):
            bound = hub_lower_bound(c, hubs)
            assert bound <= ref[0] * (1 + 1e-7) + 1e-9, (trial, hubs, bound, ref[0])
            assert bound >= lp * (1 - 1e-9)
            raised += hubs > 0 and bound > lp * (1 + 1e-6)
    assert raised > 0  # fixing hubs does charge traffic on some of them


def test_hub_bound_charges_a_star_exactly() -> None:
    """Item 0 feeds 7 spokes; memory lets a device hold 4 items, so 4 spokes sit away from the hub."""
    pytest.importorskip("scipy")
    from pc_assigner._bound import hub_lower_bound
    from pc_assigner._ilp import lp_lower_bound

    p = PlacementProblem(
        sizes=(1,) * 8,
        compute=(1,) * 8,
        capacities=(4, 4),
        speeds=(1, 1),
        distance=((0, 1), (1, 0)),
        traffic={(0, i): 0.5 for i in range(1, 8)},
    )
    c = compile_problem(p)
    optimum = solve_placement(p, method="exact").cost.total
    assert optimum == pytest.approx(4 + 4 * 0.5)
    assert lp_lower_bound(c) == pytest.approx(4.0)  # split spokes cross no edge
    assert hub_lower_bound(c, 1) == pytest.approx(optimum)
    with pytest.raises(ValueError, match="hubs"):
        hub_lower_bound(c, -1)


def test_hub_bound_is_below_the_stored_proven_optima() -> None:
    pytest.importorskip("scipy")
    from pc_assigner._bound import hub_lower_bound

    checked = 0
    for f in sorted(OPTIMA.glob("n0[48]-*.json")):
        rec = json.loads(f.read_text())
        if rec["proof"] not in ("exhaustive", "ilp") or not rec["problem"]["traffic"]:
            continue
        c = compile_problem(PlacementProblem.from_dict(rec["problem"]))
        bound = hub_lower_bound(c)
        assert math.isfinite(bound)
        assert bound <= rec["cost"] * (1 + 1e-6), rec["name"]
        checked += 1
    assert checked >= 15


def test_blended_order_puts_heavy_items_before_light_neighbours() -> None:
    from pc_assigner._core import traffic_order

    p = PlacementProblem(
        sizes=(1,) * 4,
        compute=(5, 1, 1, 4),
        capacities=(10, 10),
        speeds=(1, 1),
        distance=((0, 1), (1, 0)),
        traffic={(0, 1): 2.0, (1, 2): 2.0, (2, 3): 0.5},
    )
    c = compile_problem(p)
    assert traffic_order(c) == [0, 1, 2, 3]  # neighbours first: 1 (pull 2), then 2 (pull 2)
    assert traffic_order(c, blend=True) == [0, 3, 1, 2]  # 3 weighs 4 > 1's 1 + 2


def test_branch_and_bound_second_order_still_proves_the_optimum() -> None:
    """With the first order's round cut to a few children, the second order must finish the proof."""
    from pc_assigner import _bnb

    rng = random.Random(23)
    second_used = 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_bnb, "_FIRST_ROUND", 8)
        for trial in range(20):
            p = random_problem(rng, rng.randint(4, 7), rng.randint(2, 3), rng.choice([0.9, 1.2]), False)
            ref = brute_force(p)
            if ref is None:
                continue
            c = compile_problem(p)
            speeds = tuple(p.effective_speeds[j] for j in c.devices)
            res = _bnb.branch_and_bound(c, speeds, None)
            assert res.proven, trial
            assert res.cost == pytest.approx(ref[0], rel=1e-9), trial
            second_used += res.nodes > 8
            cut = _bnb.branch_and_bound(c, speeds, None, node_budget=5)
            assert not cut.proven
            assert cut.nodes >= 5
    assert second_used >= 10
