"""Greedy construction, feasibility repair and iterated local search (moves and swaps).

Every step keeps memory feasible, and costs are updated incrementally (O(degree + m) per candidate move).
Plateaus of the makespan (two devices sharing the maximum) are crossed by a secondary objective, the sum of
squared device times, which only breaks ties: a move is taken when it lowers the cost, or keeps it and lowers
the secondary. Randomness comes only from a local ``random.Random(seed)``; the number of restarts is fixed, so
the same input and seed always give the same placement.
"""

from __future__ import annotations

import random

from pc_assigner._core import Compiled, traffic_order
from pc_assigner._local import VECTOR_MIN_N, vector_local_search
from pc_assigner.problem import fits

__all__ = ["default_restarts", "first_feasible", "greedy", "heuristic_search", "local_search", "repair"]

_MAX_PASSES = 200  # a safety bound; local search converges long before it in practice


class _State:
    """A feasible assignment with its device times, memory and communication, updated in place."""

    def __init__(self, c: Compiled, a: list[int]) -> None:
        self.c = c
        self.a = list(a)
        self.loads = [0.0] * c.m
        self.mem = [0.0] * c.m
        for i, j in enumerate(self.a):
            self.loads[j] += c.time[i][j]
            self.mem[j] += c.size[i]
        self.comm = sum(w * c.dist[self.a[i]][self.a[k]] for i, k, w in c.edges)

    def cost_of(self, loads: list[float], comm: float) -> float:
        return self.c.alpha * max(loads) + self.c.beta * comm

    def move_delta(self, i: int, dst: int) -> float:
        """Change of communication if item i moves to ``dst``."""
        c, a = self.c, self.a
        src = a[i]
        d = 0.0
        for k, w in c.out_edges[i]:
            ak = a[k]
            d += w * (c.dist[dst][ak] - c.dist[src][ak])
        for k, w in c.in_edges[i]:
            ak = a[k]
            d += w * (c.dist[ak][dst] - c.dist[ak][src])
        return d

    def apply_move(self, i: int, dst: int, dcomm: float) -> None:
        c = self.c
        src = self.a[i]
        self.loads[src] -= c.time[i][src]
        self.loads[dst] += c.time[i][dst]
        self.mem[src] -= c.size[i]
        self.mem[dst] += c.size[i]
        self.comm += dcomm
        self.a[i] = dst


def _max_except(loads: list[float], order: list[int], a: int, b: int) -> float:
    """The largest load among devices other than ``a`` and ``b`` (``order``: devices by decreasing load)."""
    for j in order:
        if j != a and j != b:
            return loads[j]
    return 0.0


def local_search(c: Compiled, a: list[int]) -> list[int]:
    """First-improvement moves and swaps from a feasible ``a`` until no step improves; returns a new list.

    A candidate is priced in O(degree) without copying the loads: the new makespan is the larger of the two
    changed devices and the largest untouched one (read from the devices sorted by load, refreshed after
    every accepted step), and the secondary objective changes by the two devices' squares only. From
    ``VECTOR_MIN_N`` items on, the same steps are priced with numpy (:mod:`pc_assigner._local`).
    """
    if c.n >= VECTOR_MIN_N and c.m > 1:
        return vector_local_search(c, a)
    s = _State(c, a)
    m, n = c.m, c.n
    time, size, cap, alpha, beta = c.time, c.size, c.cap, c.alpha, c.beta
    loads, mem, asg = s.loads, s.mem, s.a
    order = sorted(range(m), key=lambda j: -loads[j])
    for _ in range(_MAX_PASSES):
        improved = False
        cost = alpha * loads[order[0]] + beta * s.comm
        for i in range(n):
            src = asg[i]
            for dst in range(m):
                if dst == src or not fits(mem[dst] + size[i], cap[dst]):
                    continue
                ls = loads[src] - time[i][src]
                ld = loads[dst] + time[i][dst]
                span = max(ls, ld, _max_except(loads, order, src, dst))
                dcomm = s.move_delta(i, dst) if beta else 0.0
                new_cost = alpha * span + beta * (s.comm + dcomm)
                dsq = ls * ls + ld * ld - loads[src] ** 2 - loads[dst] ** 2
                if _better_delta(new_cost, dsq, cost, loads):
                    s.apply_move(i, dst, dcomm)
                    order.sort(key=lambda j: -loads[j])
                    cost, improved = new_cost, True
                    src = dst
        for i in range(n):
            for k in range(i + 1, n):
                ji, jk = asg[i], asg[k]
                if ji == jk:
                    continue
                if not fits(mem[ji] - size[i] + size[k], cap[ji]) or not fits(
                    mem[jk] - size[k] + size[i], cap[jk]
                ):
                    continue
                li = loads[ji] + time[k][ji] - time[i][ji]
                lk = loads[jk] + time[i][jk] - time[k][jk]
                span = max(li, lk, _max_except(loads, order, ji, jk))
                dcomm = 0.0
                if beta:
                    d1 = s.move_delta(i, jk)
                    asg[i] = jk
                    d2 = s.move_delta(k, ji)
                    asg[i] = ji
                    dcomm = d1 + d2
                new_cost = alpha * span + beta * (s.comm + dcomm)
                dsq = li * li + lk * lk - loads[ji] ** 2 - loads[jk] ** 2
                if _better_delta(new_cost, dsq, cost, loads):
                    s.apply_move(i, jk, 0.0)
                    s.apply_move(k, ji, 0.0)
                    s.comm += dcomm
                    order.sort(key=lambda j: -loads[j])
                    cost, improved = new_cost, True
        if not improved:
            break
    return s.a


def _better_delta(new_cost: float, dsq: float, cost: float, loads: list[float]) -> bool:
    """A lower cost, or the same cost and a lower sum of squared loads (by more than rounding)."""
    if new_cost < cost - abs(cost) * 1e-12:
        return True
    if new_cost > cost:
        return False
    return dsq < -1e-12 * sum(x * x for x in loads)


def greedy(c: Compiled, order: list[int] | None = None) -> list[int] | None:
    """Place items (by decreasing compute, then size, then index) on the cheapest device that fits.

    Returns:
        A feasible assignment, or ``None`` if some item found no device with room.
    """
    if order is None:
        order = sorted(range(c.n), key=lambda i: (-max(c.time[i], default=0.0), -c.size[i], i))
    a = [-1] * c.n
    loads = [0.0] * c.m
    mem = [0.0] * c.m
    for i in order:
        best: tuple[float, int] | None = None
        span = max(loads)
        for j in range(c.m):
            if not fits(mem[j] + c.size[i], c.cap[j]):
                continue
            dcomm = 0.0
            for k, w in c.out_edges[i]:
                if a[k] >= 0:
                    dcomm += w * c.dist[j][a[k]]
            for k, w in c.in_edges[i]:
                if a[k] >= 0:
                    dcomm += w * c.dist[a[k]][j]
            value = c.alpha * max(span, loads[j] + c.time[i][j]) + c.beta * dcomm
            if best is None or value < best[0]:
                best = (value, j)
        if best is None:
            return None
        j = best[1]
        a[i] = j
        loads[j] += c.time[i][j]
        mem[j] += c.size[i]
    return a


def segments(c: Compiled, order: list[int]) -> list[int] | None:
    """Cut ``order`` into consecutive runs, one per device, of about equal time: a start that cuts few edges.

    Devices are filled in index order up to the balanced time ``sum(compute) / sum(speeds)``; an item goes
    to the next device when it would overshoot the level by more than half its own time there, or does not
    fit. Where items keep traffic local in ``order`` (a chain of layers in index order, or
    :func:`~pc_assigner._core.traffic_order`), only the edges between runs are cut; local search then
    balances the times.

    Returns:
        A feasible assignment, or ``None`` when the runs do not fit the memory.
    """
    ref = max(c.time, key=lambda row: row[0], default=())  # time[i][j] = compute_i / speed_j
    rel = sum(ref[0] / t for t in ref) if ref and ref[0] > 0 else 1.0  # sum of speeds / speed of device 0
    level = sum(row[0] for row in c.time) / rel  # in device 0's time: the same level on every device
    a = [-1] * c.n
    loads = [0.0] * c.m
    mem = [0.0] * c.m
    j = 0
    for i in order:
        while j < c.m - 1 and (loads[j] + c.time[i][j] / 2 > level or not fits(mem[j] + c.size[i], c.cap[j])):
            j += 1
        if not fits(mem[j] + c.size[i], c.cap[j]):
            return None
        a[i] = j
        loads[j] += c.time[i][j]
        mem[j] += c.size[i]
    return a


def repair(c: Compiled, a: list[int]) -> list[int] | None:
    """Move and swap items to remove memory overflow; returns a feasible assignment or ``None``."""
    a = list(a)
    mem = [0.0] * c.m
    for i, j in enumerate(a):
        mem[j] += c.size[i]

    def over(j: int, value: float) -> float:
        return 0.0 if fits(value, c.cap[j]) else value - c.cap[j]

    for _ in range(_MAX_PASSES):
        if all(over(j, mem[j]) == 0.0 for j in range(c.m)):
            return a
        improved = False
        for i in range(c.n):
            src = a[i]
            if over(src, mem[src]) == 0.0:
                continue
            for dst in range(c.m):
                if dst == src:
                    continue
                before = over(src, mem[src]) + over(dst, mem[dst])
                after = over(src, mem[src] - c.size[i]) + over(dst, mem[dst] + c.size[i])
                if after < before:
                    mem[src] -= c.size[i]
                    mem[dst] += c.size[i]
                    a[i] = src = dst
                    improved = True
                    break
        if improved:
            continue
        for i in range(c.n):
            for k in range(c.n):
                ji, jk = a[i], a[k]
                if ji == jk or c.size[i] <= c.size[k] or over(ji, mem[ji]) == 0.0:
                    continue
                delta = c.size[i] - c.size[k]
                before = over(ji, mem[ji]) + over(jk, mem[jk])
                after = over(ji, mem[ji] - delta) + over(jk, mem[jk] + delta)
                if after < before:
                    mem[ji] -= delta
                    mem[jk] += delta
                    a[i], a[k] = jk, ji
                    improved = True
                    break
            if improved:
                break
        if not improved:
            return None
    return None


def first_feasible(c: Compiled) -> list[int] | None:
    """A feasible start: cost greedy, else best-fit by decreasing size, else repair of a spread placement."""
    a = greedy(c)
    if a is not None:
        return a
    a = [-1] * c.n
    mem = [0.0] * c.m
    ok = True
    for i in sorted(range(c.n), key=lambda i: (-c.size[i], i)):
        room = [(c.cap[j] - mem[j] - c.size[i], j) for j in range(c.m) if fits(mem[j] + c.size[i], c.cap[j])]
        if not room:
            ok = False
            j = max(range(c.m), key=lambda j: (c.cap[j] - mem[j], -j))
        else:
            j = min(room)[1]
        a[i] = j
        mem[j] += c.size[i]
    return a if ok else repair(c, a)


def default_restarts(n: int) -> int:
    """Restart rounds of :func:`heuristic_search` for n items (see its ``restarts``)."""
    if n <= 48:
        return min(64, max(8, 4 * n))
    return max(2, int(32 * (48 / n) ** 2))


def heuristic_search(c: Compiled, *, seed: int = 0, restarts: int | None = None) -> list[int] | None:
    """Greedy, local search, then restarts: perturb the best (or a random-order greedy) and search again.

    Args:
        c: The compiled problem.
        seed: Seed of the local ``random.Random`` used for perturbations.
        restarts: Number of perturbation rounds; default ``4 * n`` capped to [8, 64] up to n = 48, then
            fewer as n grows (a local search costs O(n^2) per pass): ``32 * (48 / n) ** 2``, at least 2.

    Returns:
        The best feasible assignment found, or ``None`` if none was found (which does not prove that none
        exists).
    """
    if c.n == 0:
        return []
    start = first_feasible(c)
    if start is None:
        return None
    best = local_search(c, start)
    best_cost = c.cost(best)
    if c.m == 1:
        return best
    if c.edges:  # starts that keep neighbours together: greedy in traffic order, runs in two orders
        order = traffic_order(c)
        for local in (greedy(c, order), segments(c, list(range(c.n))), segments(c, order)):
            if local is None:
                continue
            local = local_search(c, local)
            value = c.cost(local)
            if value < best_cost - abs(best_cost) * 1e-12:
                best, best_cost = local, value
    rng = random.Random(seed)
    rounds = restarts if restarts is not None else default_restarts(c.n)
    for r in range(rounds):
        if r % 3 == 2:  # a fresh start: greedy in a random order
            order = list(range(c.n))
            rng.shuffle(order)
            a = greedy(c, order)
        else:  # perturb the best: a few items, within memory or ignoring it and repairing
            a = _kick(c, best, rng, rng.randint(2, max(2, c.n // 3)), respect_memory=r % 3 == 0)
        if a is None:
            continue
        a = local_search(c, a)
        value = c.cost(a)
        if value < best_cost - abs(best_cost) * 1e-12:
            best, best_cost = a, value
    return best


def _kick(
    c: Compiled, a: list[int], rng: random.Random, kick: int, *, respect_memory: bool
) -> list[int] | None:
    """Move ``kick`` random items to random devices.

    With ``respect_memory`` only moves that fit are made; otherwise the moves ignore memory and the result
    is repaired, which lets a large item trade places with several small ones (no single move or swap can).
    """
    a = list(a)
    mem = [0.0] * c.m
    for i, j in enumerate(a):
        mem[j] += c.size[i]
    for i in rng.sample(range(c.n), min(kick, c.n)):
        j = rng.randrange(c.m)
        if j != a[i] and (not respect_memory or fits(mem[j] + c.size[i], c.cap[j])):
            mem[a[i]] -= c.size[i]
            mem[j] += c.size[i]
            a[i] = j
    return a if respect_memory else repair(c, a)
