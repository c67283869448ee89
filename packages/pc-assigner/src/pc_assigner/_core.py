"""The problem restricted to eligible devices, in the flat form every solver works on.

Solvers see devices ``0..m'-1`` (the eligible ones) and items ``0..n-1``; :meth:`Compiled.expand` maps a
result back to the problem's device indices. Nothing here allocates tensors: the heuristics run on Python
lists, which are faster than torch for the O(degree + m) incremental updates they make.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pc_assigner.problem import PlacementProblem, fits

__all__ = ["Compiled", "compile_problem", "identical_device_classes", "traffic_order"]


@dataclass(frozen=True)
class Compiled:
    """Flat data of a problem over its eligible devices.

    Attributes:
        n: Items.
        m: Eligible devices.
        devices: Problem index of each eligible device.
        time: ``time[i][j]`` = compute of item i on eligible device j.
        size: Memory per item.
        cap: Capacity per eligible device.
        dist: Distance between eligible devices.
        out_edges: ``out_edges[i]`` = ``[(k, w), ...]`` for traffic from i.
        in_edges: ``in_edges[i]`` = ``[(k, w), ...]`` for traffic into i.
        edges: ``(i, k, w)`` triples.
        alpha: Makespan weight.
        beta: Communication weight.
    """

    n: int
    m: int
    devices: tuple[int, ...]
    time: tuple[tuple[float, ...], ...]
    size: tuple[float, ...]
    cap: tuple[float, ...]
    dist: tuple[tuple[float, ...], ...]
    out_edges: tuple[tuple[tuple[int, float], ...], ...]
    in_edges: tuple[tuple[tuple[int, float], ...], ...]
    edges: tuple[tuple[int, int, float], ...]
    alpha: float
    beta: float

    def expand(self, local: list[int] | tuple[int, ...]) -> tuple[int, ...]:
        """Map an assignment over eligible devices to problem device indices."""
        return tuple(self.devices[j] for j in local)

    def cost(self, a: list[int] | tuple[int, ...]) -> float:
        """Total cost of a local assignment (memory not checked)."""
        loads = [0.0] * self.m
        for i, j in enumerate(a):
            loads[j] += self.time[i][j]
        comm = sum(w * self.dist[a[i]][a[k]] for i, k, w in self.edges)
        return self.alpha * max(loads) + self.beta * comm

    def feasible(self, a: list[int] | tuple[int, ...]) -> bool:
        """Whether a local assignment respects every capacity."""
        mem = [0.0] * self.m
        for i, j in enumerate(a):
            mem[j] += self.size[i]
        return all(fits(mem[j], self.cap[j]) for j in range(self.m))


def compile_problem(problem: PlacementProblem) -> Compiled:
    """Restrict ``problem`` to its eligible devices and precompute per-item times and adjacency."""
    devices = problem.eligible
    speeds = problem.effective_speeds
    time = tuple(tuple((c / speeds[j] if c > 0 else 0.0) for j in devices) for c in problem.compute)
    out_edges: list[list[tuple[int, float]]] = [[] for _ in range(problem.n)]
    in_edges: list[list[tuple[int, float]]] = [[] for _ in range(problem.n)]
    for i, k, w in problem.traffic:
        out_edges[i].append((k, w))
        in_edges[k].append((i, w))
    return Compiled(
        n=problem.n,
        m=len(devices),
        devices=devices,
        time=time,
        size=problem.sizes,
        cap=tuple(problem.capacities[j] for j in devices),
        dist=tuple(tuple(problem.distance[j][k] for k in devices) for j in devices),
        out_edges=tuple(tuple(e) for e in out_edges),
        in_edges=tuple(tuple(e) for e in in_edges),
        edges=problem.traffic,
        alpha=problem.alpha,
        beta=problem.beta,
    )


def identical_device_classes(c: Compiled) -> list[list[int]]:
    """Group eligible devices that are interchangeable (same capacity, item times and distances).

    Swapping two devices of one class maps every placement to one of equal cost and feasibility, so exact
    search only needs placements whose devices of a class are first used in increasing index order.
    """
    classes: list[list[int]] = []
    for j in range(c.m):
        for cls in classes:
            r = cls[0]
            if _interchangeable(c, r, j):
                cls.append(j)
                break
        else:
            classes.append([j])
    return classes


def _interchangeable(c: Compiled, a: int, b: int) -> bool:
    if c.cap[a] != c.cap[b] and not (math.isinf(c.cap[a]) and math.isinf(c.cap[b])):
        return False
    if any(row[a] != row[b] for row in c.time):
        return False
    if c.dist[a][b] != c.dist[b][a]:
        return False
    return all(
        c.dist[a][x] == c.dist[b][x] and c.dist[x][a] == c.dist[x][b] for x in range(c.m) if x not in (a, b)
    )


def traffic_order(c: Compiled, *, blend: bool = False) -> list[int]:
    """Items in an order that keeps traffic local.

    The heaviest item comes first, then always the item with the most traffic to those already listed (ties:
    the heavier, then the lower index). With ``blend``, the next item is the one with the largest sum of its
    weight (largest time) and its traffic to those listed instead: heavy items come earlier, which lets a
    makespan bound bite sooner, while traffic still pulls neighbours along.

    Branch and bound places items in this order (edges are decided early, so its traffic bound bites), and the
    heuristic's second greedy start uses it (neighbours land on one device before balancing splits them).
    """
    weight = [max(row, default=0.0) for row in c.time]
    link = [[0.0] * c.n for _ in range(c.n)]
    for i, k, w in c.edges:
        link[i][k] += w
        link[k][i] += w
    order: list[int] = []
    placed = [False] * c.n
    pull = [0.0] * c.n
    for _ in range(c.n):
        if blend:
            best = max((i for i in range(c.n) if not placed[i]), key=lambda i: (weight[i] + pull[i], -i))
        else:
            best = max((i for i in range(c.n) if not placed[i]), key=lambda i: (pull[i], weight[i], -i))
        order.append(best)
        placed[best] = True
        for k in range(c.n):
            pull[k] += link[best][k]
    return order
