"""The pure solver: exactness against brute force, feasibility, determinism, invariances, stored optima."""

from __future__ import annotations

import json
import math
import pathlib
import random
import statistics
from unittest import mock

import numpy as np
import pytest
from assigner_testutils import brute_force, random_problem

from pc_assigner import (
    InfeasiblePlacementError,
    PlacementProblem,
    placement_cost,
    solve_placement,
)
from pc_assigner._core import compile_problem, identical_device_classes

OPTIMA = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "optima"


def _problems(count: int, seed: int, n_max: int = 7) -> list[PlacementProblem]:
    rng = random.Random(seed)
    return [
        random_problem(
            rng,
            rng.randint(1, n_max),
            rng.randint(1, 4),
            rng.choice([0.6, 0.9, 1.2, 1.5]),
            rng.random() < 0.5,
        )
        for _ in range(count)
    ]


def test_cost_breakdown_exact_numbers() -> None:
    p = PlacementProblem(
        sizes=(1, 2, 3),
        compute=(2, 4, 6),
        capacities=(3, 3),
        speeds=(1, 0.5),
        distance=((0, 1), (10, 0)),
        traffic={(0, 1): 1, (1, 2): 2, (2, 0): 0.5},
        alpha=2,
        beta=3,
    )
    c = placement_cost(p, [0, 0, 1])
    assert (c.makespan, c.communication, c.memory, c.feasible) == (12.0, 2 * 1 + 0.5 * 10, (3.0, 3.0), True)
    assert c.total == 2 * 12 + 3 * 7
    assert not placement_cost(p, [1, 1, 1]).feasible
    with pytest.raises(ValueError, match="3 entries"):
        placement_cost(p, [0])
    with pytest.raises(ValueError, match=r"assignment\[1\]"):
        placement_cost(p, [0, 2, 0])


def test_exact_equals_brute_force_including_ties_and_infeasibility() -> None:
    seen_infeasible = 0
    for p in _problems(40, seed=11, n_max=6):
        ref = brute_force(p)
        if ref is None:
            seen_infeasible += 1
            with pytest.raises(InfeasiblePlacementError) as info:
                solve_placement(p)
            assert info.value.proven
            continue
        r = solve_placement(p, method="exact")
        assert r.optimal
        assert r.cost.feasible
        assert r.assignment == ref[1]
        assert math.isclose(r.cost.total, ref[0], rel_tol=1e-9)
    assert seen_infeasible > 0  # the random set covers the infeasible path too


def test_branch_and_bound_equals_brute_force_and_proves_infeasibility() -> None:
    seen_infeasible = proven = 0
    for p in _problems(40, seed=21, n_max=6):
        ref = brute_force(p)
        if ref is None:
            seen_infeasible += 1
            with pytest.raises(InfeasiblePlacementError):
                solve_placement(p, method="bnb")
            continue
        r = solve_placement(p, method="bnb")
        assert r.method == "bnb"
        assert r.cost.feasible
        assert math.isclose(r.cost.total, ref[0], rel_tol=1e-9), (r, ref)
        proven += r.optimal
    assert seen_infeasible > 0
    assert proven >= 30  # tiny problems are proven, not just found


def test_auto_uses_branch_and_bound_above_the_exhaustive_limit_and_is_optimal() -> None:
    rng = random.Random(31)
    checked = 0
    for tight, cpu in ((0.9, True), (1.2, False), (1.5, True), (0.6, False)):
        p = random_problem(rng, 7, 4, tight, cpu=cpu)  # 4**7 = 16384 > AUTO_EXACT_LIMIT placements
        ref = brute_force(p)
        if ref is None:
            continue
        r = solve_placement(p)
        assert (r.method, r.optimal) == ("bnb", True)
        assert math.isclose(r.cost.total, ref[0], rel_tol=1e-9)
        checked += 1
    assert checked >= 3


def test_branch_and_bound_out_of_budget_is_feasible_and_not_called_optimal() -> None:
    p = random_problem(random.Random(8), 9, 3, 1.2)
    exact = solve_placement(p, method="exact")
    r = solve_placement(p, method="bnb", node_budget=1)
    assert not r.optimal
    assert r.cost.feasible
    assert r.cost.total >= exact.cost.total * (1 - 1e-9)
    auto = solve_placement(p, node_budget=1)  # auto adds the heuristic when the proof runs out
    assert not auto.optimal
    assert auto.cost.total <= r.cost.total * (1 + 1e-12)
    with pytest.raises(ValueError, match="node_budget"):
        solve_placement(p, node_budget=0)


def test_span_floor_is_the_largest_load_or_the_water_level() -> None:
    from pc_assigner._bnb import _span_floor

    loads = np.array([[0.0, 2.0, 10.0], [5.0, 5.0, 5.0], [0.0, 2.0, 3.0]])
    speeds = np.array([1.0, 2.0, 1.0])
    # row 0: the water level is 4 (device 0 takes 4, device 1 takes 2 * 2), below the largest load 10
    # row 1: 8 more work over speeds summing to 4 raises every device by 2
    # row 2: every device fills: (8 + 0 + 4 + 3) / 4
    assert _span_floor(loads, speeds, 8.0).tolist() == pytest.approx([10.0, 7.0, 3.75])

    def level_by_bisection(row: np.ndarray, work: float) -> float:
        lo, hi = 0.0, float(row.max()) + work / float(speeds.min())
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if (speeds * np.clip(mid - row, 0, None)).sum() >= work else (mid, hi)
        return hi

    rng = np.random.default_rng(3)
    for _ in range(200):
        row = rng.uniform(0, 10, size=3) * (rng.random(3) < 0.8)
        work = float(rng.uniform(0, 20))
        want = max(float(row.max()), level_by_bisection(row, work))
        assert _span_floor(row[None, :], speeds, work)[0] == pytest.approx(want, rel=1e-9, abs=1e-9)


def test_heuristic_feasible_whenever_a_placement_exists_and_close_to_optimal() -> None:
    ratios = []
    for p in _problems(50, seed=12, n_max=9):
        try:
            ref = solve_placement(p, method="exact").cost.total  # checked against brute force above
        except InfeasiblePlacementError:
            continue
        for method in ("heuristic", "greedy", "gradient"):
            r = solve_placement(p, method=method, gradient_options={"iterations": 10})  # type: ignore[arg-type]
            assert r.cost.feasible, (method, p)
            assert r.cost.total >= ref * (1 - 1e-9)
            if method == "heuristic":
                ratios.append(r.cost.total / ref if ref else 1.0)
    assert len(ratios) >= 30
    assert statistics.mean(ratios) <= 1.02
    assert max(ratios) <= 1.2


def test_deterministic_for_a_seed_and_unit_invariant() -> None:
    rng = random.Random(5)
    big = random_problem(rng, 20, 4, 1.2)
    first = solve_placement(big, seed=7)
    assert first.method == "heuristic"
    assert solve_placement(big, seed=7) == first
    assert solve_placement(big.scaled_memory(1000), seed=7).assignment == first.assignment
    assert solve_placement(big.scaled_memory(1 / 1024), seed=7).assignment == first.assignment
    small = random_problem(rng, 6, 3, 1.2)
    assert solve_placement(small.scaled_memory(1000)).assignment == solve_placement(small).assignment


def test_identical_devices_are_interchangeable() -> None:
    rng = random.Random(3)
    p = random_problem(rng, 6, 4, 1.2, cpu=True)
    assert identical_device_classes(compile_problem(p)) == [[0, 1, 2], [3]]
    r = solve_placement(p)
    # relabelling the identical GPUs gives a placement of the same cost
    for perm in ([1, 0, 2, 3], [2, 1, 0, 3]):
        relabelled = [perm[j] for j in r.assignment]
        assert math.isclose(placement_cost(p, relabelled).total, r.cost.total, rel_tol=1e-12)
    # and the canonical answer uses the identical devices in first-use order
    gpus = [j for j in r.assignment if j < 3]
    firsts = [gpus.index(j) for j in sorted(set(gpus))]
    assert firsts == sorted(firsts)


def test_no_nan_in_degenerate_problems() -> None:
    cases = [
        PlacementProblem(sizes=(1, 1), compute=(0, 0), capacities=(2,), speeds=(0,), distance=((0,),)),
        PlacementProblem(
            sizes=(1, 1), compute=(1, 1), capacities=(2, 2), speeds=(0, 0), distance=((0, 0), (0, 0))
        ),
        PlacementProblem(sizes=(), compute=(), capacities=(1,), speeds=(1,), distance=((0,),)),
        PlacementProblem(
            sizes=(1,), compute=(1,), capacities=(math.inf,), speeds=(1,), distance=((0,),), alpha=0, beta=0
        ),
    ]
    for p in cases:
        for method in ("auto", "heuristic", "greedy", "gradient"):
            r = solve_placement(p, method=method, gradient_options={"iterations": 5})  # type: ignore[arg-type]
            assert math.isfinite(r.cost.total)
            assert r.cost.feasible


def test_zero_speed_devices_are_left_out() -> None:
    p = PlacementProblem(
        sizes=(1, 1, 1), compute=(1, 1, 1), capacities=(10, 10), speeds=(1, 0), distance=((0, 1), (1, 0))
    )
    assert solve_placement(p).assignment == (0, 0, 0)
    assert solve_placement(p, method="heuristic").assignment == (0, 0, 0)


def test_ilp_matches_exact() -> None:
    pytest.importorskip("scipy")
    for p in _problems(6, seed=21, n_max=6):
        ref = brute_force(p)
        if ref is None:
            with pytest.raises(InfeasiblePlacementError):
                solve_placement(p, method="ilp", time_limit=30)
            continue
        r = solve_placement(p, method="ilp", time_limit=30)
        assert r.cost.feasible
        assert math.isclose(r.cost.total, ref[0], rel_tol=1e-4)


def test_without_scipy_an_unfound_placement_is_not_called_infeasible() -> None:
    p = random_problem(random.Random(1), 12, 4, 1.2)
    with (
        mock.patch("pc_assigner.solve.heuristic_search", return_value=None),
        mock.patch("pc_assigner.solve.ilp_available", return_value=False),
        pytest.raises(InfeasiblePlacementError, match="not proven infeasible") as info,
    ):
        solve_placement(p, method="heuristic")
    assert not info.value.proven
    assert isinstance(info.value, RuntimeError)


def test_solver_bad_input() -> None:
    p = random_problem(random.Random(2), 4, 2, 1.5)
    with pytest.raises(ValueError, match="method must be one of"):
        solve_placement(p, method="best")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="PlacementProblem"):
        solve_placement({"sizes": []})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="above the limit"):
        solve_placement(random_problem(random.Random(2), 12, 4, 1.5), method="exact")
    with pytest.raises(TypeError, match="seed"):
        solve_placement(p, seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one entry per device"):
        PlacementProblem(sizes=(1,), compute=(1,), capacities=(1, 1), speeds=(1,), distance=((0,),))
    with pytest.raises(ValueError, match=r"distance\[0\]\[0\] must be 0"):
        PlacementProblem(sizes=(1,), compute=(1,), capacities=(1,), speeds=(1,), distance=((1,),))
    with pytest.raises(ValueError, match=r"sizes\[0\]"):
        PlacementProblem(sizes=(-1,), compute=(1,), capacities=(1,), speeds=(1,), distance=((0,),))
    with pytest.raises(TypeError, match=r"compute\[0\] must be a number"):
        PlacementProblem(sizes=(1,), compute=("x",), capacities=(1,), speeds=(1,), distance=((0,),))  # type: ignore[arg-type]


def test_stored_optima_are_met() -> None:
    """Stored instances up to n = 16 (the benchmark runs all): exact where m**n <= 1e6; no scipy needed."""
    records = [json.loads(f.read_text()) for f in sorted(OPTIMA.glob("*.json"))]
    assert len(records) >= 70
    records = [r for r in records if r["params"]["n"] <= 16]
    ratios = []
    for rec in records:
        p = PlacementProblem.from_dict(rec["problem"])
        if rec["proof"] == "infeasible":
            with pytest.raises(InfeasiblePlacementError):
                solve_placement(p)
            continue
        r = solve_placement(p)
        assert r.cost.feasible, rec["name"]
        ratio = r.cost.total / rec["cost"]
        if rec["proof"] == "exhaustive":
            assert r.optimal, rec["name"]
            assert math.isclose(ratio, 1.0, rel_tol=1e-9), rec["name"]
        if rec["params"]["n"] <= 10:
            assert ratio <= 1.2, rec["name"]
        ratios.append(ratio)
    assert statistics.mean(ratios) <= 1.02
