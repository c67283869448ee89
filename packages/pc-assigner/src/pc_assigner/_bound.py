"""A lower bound that charges traffic: the LP relaxation with the busiest items' placements enumerated.

The LP relaxation of :mod:`pc_assigner._ilp` is weak where traffic matters: an item split evenly over the
devices lies "with" every neighbour split the same way, so it charges no edge, and on most instances its
optimum is the balanced makespan alone. Fixing a few items integrally takes that freedom away from their
edges.
For a set H of *hub* items (those with the most traffic)::

    bound = min over placements p of H of  LP(items of H fixed where p puts them)

**Why it is a lower bound.** Let ``a*`` be an optimal placement, and p its restriction to H. ``a*`` places
every item of H where p does, so it is a feasible point of LP(p), and its objective there is its true cost
(``x`` integral, each edge's ``y`` at its lowest value, 1 exactly on the crossed device pair). So LP(p) <=
cost(a*), and the minimum over all p is at most LP(p). Placements p that no feasible placement extends
(memory) give an infeasible LP and are skipped; if all are infeasible, so is the problem. Interchangeable
devices (:func:`~pc_assigner._core.identical_device_classes`) map any p to one whose devices of a class are
first used in index order without changing the LP (its data is invariant under the swap), so only those are
solved. Each LP(p) is also a restriction of the plain relaxation, so the bound is never below it.

On a hub-and-spoke graph (every item talks to item 0 and to item n - 1, as in an actor-critic loop) two hubs
turn the traffic of every spoke into a linear cost of where that spoke goes, and the bound moves from the
makespan alone to within a few per cent of the best placement found; on chains it adds little (no item
dominates the traffic). It costs up to ``m ** hubs`` LP solves, so it is for measuring solvers (the
benchmark), not for solving.
"""

from __future__ import annotations

import math

from pc_assigner._checks import int_at_least
from pc_assigner._core import Compiled, identical_device_classes
from pc_assigner._exact import _canonical_prefixes
from pc_assigner._ilp import lp_relaxation

__all__ = ["hub_items", "hub_lower_bound"]


def hub_items(c: Compiled, hubs: int) -> list[int]:
    """The ``hubs`` items with the most traffic (sent plus received; ties: lower index).

    Items without traffic are never hubs.
    """
    weight = [0.0] * c.n
    for i, k, w in c.edges:
        weight[i] += w
        weight[k] += w
    ranked = sorted((i for i in range(c.n) if weight[i] > 0), key=lambda i: (-weight[i], i))
    return ranked[:hubs]


def hub_lower_bound(c: Compiled, hubs: int = 2) -> float:
    """A lower bound on the cost of every feasible placement of ``c`` (see the module's docstring).

    Args:
        c: The compiled problem.
        hubs: Items whose placements are enumerated (``0``: the plain LP relaxation).

    Returns:
        ``max(plain LP optimum, min over hub placements of the LP with them fixed)``.

    Raises:
        ImportError: if scipy is not installed.
        TypeError: if ``hubs`` is not an int.
        ValueError: if ``hubs`` is negative, or no placement fits (every LP is infeasible).
    """
    int_at_least("hubs", hubs, 0)
    base = lp_relaxation(c)
    if base is None:
        raise ValueError("no placement fits the memory limits: the LP relaxation is infeasible")
    chosen = hub_items(c, hubs) if c.m > 1 and c.beta else []
    if not chosen:
        return base
    best = math.inf
    for placement in _canonical_prefixes(len(chosen), c.m, identical_device_classes(c)):
        value = lp_relaxation(c, dict(zip(chosen, placement, strict=True)))
        if value is not None:
            best = min(best, value)
    if math.isinf(best):
        raise ValueError(
            "no placement fits the memory limits: every placement of the hub items is infeasible"
        )
    return max(base, best)
