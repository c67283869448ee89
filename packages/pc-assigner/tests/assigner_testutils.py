"""Helpers of the pc-assigner tests: random instances and a brute-force reference."""

from __future__ import annotations

import itertools
import random

from pc_assigner import PlacementProblem, placement_cost


def random_problem(rng: random.Random, n: int, m: int, tight: float, cpu: bool = True) -> PlacementProblem:
    """A random instance: lognormal sizes/compute, chain plus skip traffic, optional slow CPU."""
    sizes = [float(int(rng.lognormvariate(0, 1) * 1000)) for _ in range(n)]
    compute = [rng.lognormvariate(0, 1) for _ in range(n)]
    cap = max(sum(sizes) * tight / m, max(sizes))
    speeds = [1.0] * m
    dist = [[0.0 if a == b else 0.1 for b in range(m)] for a in range(m)]
    if cpu and m > 1:
        speeds[-1] = 0.1
        for j in range(m - 1):
            dist[j][m - 1] = dist[m - 1][j] = 1.0
    traffic = {(i, i + 1): rng.lognormvariate(0, 1) for i in range(n - 1)}
    traffic.update({(i, i + 2): rng.random() for i in range(n - 2) if rng.random() < 0.5})
    return PlacementProblem(
        sizes=tuple(sizes),
        compute=tuple(compute),
        capacities=tuple([float(int(cap))] * m),
        speeds=tuple(speeds),
        distance=tuple(tuple(r) for r in dist),
        traffic=tuple((i, k, w) for (i, k), w in sorted(traffic.items())),
    )


def brute_force(problem: PlacementProblem) -> tuple[float, tuple[int, ...]] | None:
    """The optimal (cost, lexicographically smallest assignment) over eligible devices, or None."""
    best: tuple[float, tuple[int, ...]] | None = None
    for a in itertools.product(problem.eligible, repeat=problem.n):
        c = placement_cost(problem, a)
        if c.feasible and (best is None or c.total < best[0] - 1e-12 * abs(best[0])):
            best = (c.total, a)
    return best
