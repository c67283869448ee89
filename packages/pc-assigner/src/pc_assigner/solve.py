"""Choosing and running a solver for a :class:`~pc_assigner.problem.PlacementProblem`.

``method="auto"`` searches exhaustively when ``m ** n <= AUTO_EXACT_LIMIT`` (m = eligible devices; ties go
to the lexicographically smallest placement). Above that it starts from greedy construction plus local search
and runs branch and bound from it (:mod:`pc_assigner._bnb`), which proves the optimum within its node budget.
Where the budget runs out (or n > ``AUTO_BNB_MAX_N``), the heuristic's seeded restarts run too and the better
placement is returned, unproven. When nothing feasible is found, the ILP decides if scipy is installed. Every
method returns a feasible placement or raises :class:`~pc_assigner.errors.InfeasiblePlacementError`; none
returns a placement over a device's memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from pc_assigner._bnb import DEFAULT_NODE_BUDGET, branch_and_bound
from pc_assigner._checks import integer, optional_int_at_least, positive_seconds
from pc_assigner._core import Compiled, compile_problem, identical_device_classes
from pc_assigner._exact import EXACT_LIMIT, exact_search
from pc_assigner._gd import gradient_search
from pc_assigner._heuristic import first_feasible, greedy, heuristic_search, local_search, repair
from pc_assigner._ilp import ilp_available, ilp_search
from pc_assigner.errors import InfeasiblePlacementError
from pc_assigner.problem import PlacementCost, PlacementProblem, fits, placement_cost

__all__ = ["AUTO_BNB_MAX_N", "AUTO_EXACT_LIMIT", "METHODS", "Method", "PlacementResult", "solve_placement"]

logger = logging.getLogger(__name__)

Method = Literal["auto", "exact", "bnb", "ilp", "heuristic", "greedy", "gradient"]
METHODS: tuple[str, ...] = ("auto", "exact", "bnb", "ilp", "heuristic", "greedy", "gradient")
AUTO_EXACT_LIMIT = 4096
"""``method="auto"`` searches exhaustively when ``m ** n`` is at most this (1e6 before branch and bound, which
proves the same optima faster above a few thousand placements)."""
AUTO_BNB_MAX_N = 48
"""``method="auto"`` runs branch and bound for at most this many items (beyond it, the heuristic only)."""


@dataclass(frozen=True)
class PlacementResult:
    """A feasible placement and how it was found.

    Attributes:
        assignment: Device index (into the problem's devices) of each item.
        cost: Its cost breakdown under the problem's weights.
        method: The solver that produced it: ``"exact"``, ``"bnb"`` (branch and bound), ``"ilp"``,
            ``"heuristic"``, ``"greedy"`` or ``"gradient"``.
        optimal: Whether it is proven optimal (exhaustive search, branch and bound within its budget, or an
            ILP solved to optimality).
    """

    assignment: tuple[int, ...]
    cost: PlacementCost
    method: str
    optimal: bool


def _check_totals(problem: PlacementProblem, c: Compiled) -> None:
    need = sum(c.size)
    have = sum(c.cap)
    if not fits(need, have):
        raise InfeasiblePlacementError(
            f"the items need {need:g} units of memory in total, but the usable devices "
            f"{list(c.devices)} allow only {have:g}"
        )
    biggest = max(c.cap, default=0.0)
    for i, s in enumerate(c.size):
        if not fits(s, biggest):
            raise InfeasiblePlacementError(
                f"item {i} needs {s:g} units of memory, more than any usable device allows "
                f"(largest: {biggest:g})"
            )


def _result(
    problem: PlacementProblem, c: Compiled, a: list[int] | tuple[int, ...], method: str, optimal: bool
) -> PlacementResult:
    assignment = c.expand(tuple(a))
    cost = placement_cost(problem, assignment)
    if not cost.feasible:  # pragma: no cover - every path below checks feasibility; this guards the guarantee
        raise AssertionError(f"internal error: {method} returned an infeasible placement {assignment}")
    logger.debug(
        "placement by %s (optimal=%s): %s makespan=%g communication=%g total=%g",
        method,
        optimal,
        assignment,
        cost.makespan,
        cost.communication,
        cost.total,
    )
    return PlacementResult(assignment, cost, method, optimal)


def _fallback(problem: PlacementProblem, c: Compiled, time_limit: float, tried: str) -> PlacementResult:
    if not ilp_available():
        raise InfeasiblePlacementError(
            f"{tried} found no placement within the memory limits; not proven infeasible "
            '(install scipy, pip install "pc-assigner[solver]", to let the ILP decide, '
            'or use method="exact")',
            proven=False,
        )
    res = ilp_search(c, time_limit=time_limit)
    if res.assignment is not None and c.feasible(res.assignment):
        return _result(problem, c, res.assignment, "ilp", res.proven)
    if res.proven:
        raise InfeasiblePlacementError("no placement fits the memory limits (proven by the ILP)")
    raise InfeasiblePlacementError(
        f"{tried} and the ILP ({res.message}) found no placement within the memory limits; "
        "not proven infeasible",
        proven=False,
    )


def solve_placement(
    problem: PlacementProblem,
    *,
    method: Method = "auto",
    seed: int = 0,
    restarts: int | None = None,
    time_limit: float = 30.0,
    gradient_options: dict[str, Any] | None = None,
    node_budget: int | None = None,
) -> PlacementResult:
    """Find a feasible placement of minimal cost.

    Args:
        problem: The instance.
        method: ``"auto"`` (branch and bound from a local-search start; where its node budget runs out or
            n > ``AUTO_BNB_MAX_N``, the heuristic too, and the better of the two), ``"bnb"`` (branch and bound
            alone, proven optimal unless the budget ran out), ``"exact"`` (exhaustive; ``ValueError`` above
            ``1e7`` placements), ``"ilp"`` (HiGHS; needs scipy), ``"heuristic"`` (greedy, local search,
            seeded restarts), ``"greedy"`` (construction only) or ``"gradient"`` (a gradient surrogate, then
            repaired; not recommended).
        seed: Seed of the restarts and of the gradient start; the same seed gives the same result.
        restarts: Restart rounds of the heuristic (default ``4 n`` within [8, 64]).
        time_limit: Seconds the ILP may run (``"ilp"`` and the infeasibility fallback).
        gradient_options: Keyword arguments of the surrogate for ``method="gradient"`` (``iterations``,
            ``update_rate``, ``connection_weight``, ``size_match_weight``, ``complexity_match_weight``,
            ``entropy_weight``, ``size_unit``).
        node_budget: Children branch and bound may bound before it gives up its proof (default
            ``DEFAULT_NODE_BUDGET`` of :mod:`pc_assigner._bnb`); bounds its time, which is about a
            microsecond per child.

    Returns:
        The placement, its cost breakdown and whether it is proven optimal.

    Raises:
        ValueError: for an unknown method, a bad limit or count, or ``"exact"`` on more than 1e7 placements.
        TypeError: if ``problem`` is not a :class:`PlacementProblem`, or a seed, limit or count has the wrong
            type.
        ImportError: for ``"ilp"`` without scipy.
        InfeasiblePlacementError: if no placement fits (``proven`` tells whether that is certain).

    Examples:
        >>> p = PlacementProblem(sizes=(3, 3), compute=(1, 1), capacities=(4, 4), speeds=(1, 1),
        ...                      distance=((0, 1), (1, 0)), traffic={(0, 1): 0.5})
        >>> solve_placement(p).assignment
        (0, 1)
    """
    if not isinstance(problem, PlacementProblem):
        raise TypeError(f"problem must be a PlacementProblem, got {type(problem).__name__}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    integer("seed", seed)
    positive_seconds("time_limit", time_limit)
    optional_int_at_least("restarts", restarts, 0)
    optional_int_at_least("node_budget", node_budget, 1)
    c = compile_problem(problem)
    _check_totals(problem, c)
    space = c.m**c.n
    if method == "exact" and space > EXACT_LIMIT:
        raise ValueError(
            f'method="exact" enumerates m**n = {c.m}**{c.n} = {space:.3g} placements, above the limit '
            f'{EXACT_LIMIT:.0e}; use method="auto", "heuristic" or "ilp"'
        )
    if method == "exact" or (method == "auto" and space <= AUTO_EXACT_LIMIT):
        found = exact_search(c)
        if found is None:
            raise InfeasiblePlacementError(
                "no placement fits the memory limits (proven by exhaustive search)"
            )
        return _result(problem, c, found[0], "exact", True)
    if method == "ilp":
        res = ilp_search(c, time_limit=time_limit)
        if res.assignment is not None and c.feasible(res.assignment):
            return _result(problem, c, res.assignment, "ilp", res.proven)
        raise InfeasiblePlacementError(
            f"the ILP found no feasible placement: {res.message}", proven=res.proven
        )
    if method == "greedy":
        a = greedy(c)
        if a is None:
            a = first_feasible(c)
        if a is None:
            return _fallback(problem, c, time_limit, "greedy")
        return _result(problem, c, a, "greedy", False)
    if method == "gradient":
        eff = problem.effective_speeds
        raw = gradient_search(
            c,
            seed=seed,
            complexity=problem.compute,
            speeds=tuple(eff[j] for j in c.devices),
            **(gradient_options or {}),
        )
        fixed = raw if c.feasible(raw) else repair(c, raw)
        if fixed is None:
            fixed = first_feasible(c)
        if fixed is None:
            return _fallback(problem, c, time_limit, "the gradient method and its repair")
        return _result(problem, c, fixed, "gradient", False)
    if method in ("auto", "bnb") and (method == "bnb" or c.n <= AUTO_BNB_MAX_N):
        start = first_feasible(c)
        incumbent = local_search(c, start) if start is not None else None
        eff = problem.effective_speeds
        bnb = branch_and_bound(
            c, tuple(eff[j] for j in c.devices), incumbent, node_budget=node_budget or DEFAULT_NODE_BUDGET
        )
        if bnb.proven and bnb.assignment is None:
            raise InfeasiblePlacementError("no placement fits the memory limits (proven by branch and bound)")
        if bnb.proven or method == "bnb":
            if bnb.assignment is None:
                return _fallback(problem, c, time_limit, "branch and bound (stopped at its node budget)")
            return _result(problem, c, _canonical(c, bnb.assignment), "bnb", bnb.proven)
        found_h = heuristic_search(c, seed=seed, restarts=restarts)
        if bnb.assignment is not None and (found_h is None or bnb.cost <= c.cost(found_h)):
            return _result(problem, c, _canonical(c, bnb.assignment), "bnb", False)
    else:
        found_h = heuristic_search(c, seed=seed, restarts=restarts)
    if found_h is None:
        return _fallback(problem, c, time_limit, "greedy and local search")
    return _result(problem, c, found_h, "heuristic", c.m == 1)


def _canonical(c: Compiled, a: tuple[int, ...]) -> tuple[int, ...]:
    """Relabel interchangeable devices so that each class's devices are first used in index order (by item).

    Interchangeable devices have equal capacity, times and distances, so the cost and feasibility are kept.
    """
    relabel = list(range(c.m))
    for cls in identical_device_classes(c):
        if len(cls) < 2:
            continue
        members = set(cls)
        first_use: list[int] = []
        for j in a:
            if j in members and j not in first_use:
                first_use.append(j)
        first_use += [j for j in cls if j not in first_use]
        for new, old in zip(cls, first_use, strict=True):
            relabel[old] = new
    return tuple(relabel[j] for j in a)
