"""Branch and bound over partial placements, vectorised with numpy: proven optima beyond exhaustive search.

Items are placed one at a time in a fixed order (:func:`~pc_assigner._core.traffic_order`: blended, heavy
items early, for a first bounded round; then neighbours first; see :func:`branch_and_bound`). A *block* is a
tensor of partial placements at the same depth; a block is expanded to all its children at once, each child is
bounded, and the children whose bound is not below the incumbent are dropped. Blocks wait on a stack (depth
first, the lowest bounds on top), so memory stays small.

The bound of a partial placement (a lower bound on the cost of every completion) is::

    alpha * max(largest load,
                water level: the lowest T with sum_j speed_j * max(0, T - load_j) >= remaining compute
                (with the largest load, a closed form: see _span_floor),
                max over unplaced items k of min_j (load_j + time[k][j]))
  + beta * (traffic between placed items
            + sum over unplaced items k of min_j (traffic between k and the placed items if k went to j))

and memory prunes children over a capacity, or whose remaining items exceed the room left. Interchangeable
devices are used in index order (as in exhaustive search). The search starts from an incumbent (greedy plus
local search) and stops at a node budget: it then returns the best found, unproven. numpy rather than torch:
the blocks are small and numpy's per-operation cost is a few times lower.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from pc_assigner._core import Compiled, identical_device_classes, traffic_order

__all__ = ["DEFAULT_NODE_BUDGET", "BnbResult", "branch_and_bound"]

DEFAULT_NODE_BUDGET = 100_000
"""Children bounded before the search gives up its proof and returns the incumbent."""

_BLOCK = 512  # partial placements expanded together: small blocks dive deep sooner
_FIRST_ROUND = 16_384  # children the first order may bound before the other order's turn


class BnbResult:
    """Outcome of :func:`branch_and_bound`.

    Attributes:
        assignment: Best placement found (over eligible devices), or ``None`` if none is feasible.
        cost: Its cost (``inf`` when ``assignment`` is ``None``).
        proven: Whether the search finished within its budget: the placement is then optimal (or, with
            ``assignment`` ``None``, no placement fits).
        nodes: Children bounded.
    """

    __slots__ = ("assignment", "cost", "nodes", "proven")

    def __init__(self, assignment: tuple[int, ...] | None, cost: float, proven: bool, nodes: int) -> None:
        self.assignment = assignment
        self.cost = cost
        self.proven = proven
        self.nodes = nodes


_F = npt.NDArray[np.float64]
_B = npt.NDArray[np.bool_]
# depth, prefixes, loads, memory, traffic, cross, devices used, bounds
_Block = tuple[int, npt.NDArray[np.int64], _F, _F, _F, _F, _B, _F]


def branch_and_bound(
    c: Compiled,
    speeds: tuple[float, ...],
    incumbent: list[int] | None,
    *,
    node_budget: int = DEFAULT_NODE_BUDGET,
) -> BnbResult:
    """The optimal placement of ``c``, or the best found within ``node_budget`` bounded children.

    Which order of placing the items proves an optimum soonest depends on the instance (heavy items first
    suits the makespan bound, neighbours first the traffic bound; one can take ten times the nodes of the
    other). :func:`~pc_assigner._core.traffic_order` with ``blend`` (the faster on most of the benchmark's
    instances) searches first, for up to ``_FIRST_ROUND`` children; if it has not finished, the plain traffic
    order searches again from the best placement found, with the rest of the budget. Where the two orders
    coincide (no traffic), one search has the whole budget. Deterministic.

    Args:
        c: The compiled problem.
        speeds: Speed of each eligible device (``c.time[i][j] == compute_i / speeds[j]``).
        incumbent: A feasible placement to start from (its cost prunes from the first node), or ``None``.
        node_budget: Children bounded, over both searches, before giving up the proof.

    Returns:
        The best placement, its cost, and whether it is proven optimal.
    """
    first, second = traffic_order(c, blend=True), traffic_order(c)
    if first == second:
        return _search(c, speeds, incumbent, node_budget, first)
    res = _search(c, speeds, incumbent, min(_FIRST_ROUND, node_budget), first)
    if res.proven or res.nodes >= node_budget:
        return res
    start = list(res.assignment) if res.assignment is not None else None
    more = _search(c, speeds, start, node_budget - res.nodes, second)
    return BnbResult(more.assignment, more.cost, more.proven, res.nodes + more.nodes)


def _search(
    c: Compiled, speeds: tuple[float, ...], incumbent: list[int] | None, node_budget: int, order: list[int]
) -> BnbResult:
    """One depth-first search placing the items in ``order`` (see the module's docstring)."""
    n, m = c.n, c.m
    best_a = tuple(incumbent) if incumbent is not None else None
    best = c.cost(best_a) if best_a is not None else math.inf
    if n == 0:
        return BnbResult((), 0.0, True, 0)
    pos = {item: d for d, item in enumerate(order)}
    time = np.array([c.time[i] for i in order], dtype=np.float64).reshape(n, m)  # in placement order
    size = np.array([c.size[i] for i in order], dtype=np.float64)
    cap = np.array(c.cap, dtype=np.float64)
    cap = cap + np.abs(cap) * 1e-12  # same slack as problem.fits
    spd = np.array(speeds, dtype=np.float64)
    work = np.array([c.time[i][0] * speeds[0] for i in order], dtype=np.float64)  # compute of each item
    rem_work = np.append(np.cumsum(work[::-1])[::-1], 0.0)  # from depth d on
    rem_size = np.append(np.cumsum(size[::-1])[::-1], 0.0)
    dist = np.array(c.dist, dtype=np.float64).reshape(m, m)
    # The traffic bound looks only at the *frontier*: front[d], the items at depth >= d (placement order) with
    # an edge to an item at depth < d; any other unplaced item has no traffic with the placed ones yet. A
    # block at depth d holds ``cross`` of shape (rows, m, len(front[d])): per device, each frontier item's
    # traffic cost to the placed items if it went there (devices before items, so that the minimum over
    # devices is m elementwise minima: numpy reduces a short last axis an order of magnitude slower).
    # push[d] (m, m, len(front[d + 1])): the cost added to each next-frontier item at each device when the
    # item at depth d goes to device j.
    full = np.zeros((n, m, m, n), dtype=np.float64)
    first_link = [n] * n  # the smallest depth an item has an edge with
    for i, k, w in c.edges:
        di, dk = pos[i], pos[k]
        first_link[di], first_link[dk] = min(first_link[di], dk), min(first_link[dk], di)
        if di < dk:  # i placed first at j: k at q pays w * dist[j][q]
            full[di, :, :, dk] += w * dist
        elif dk < di:  # k placed first at j: i at q pays w * dist[q][j]
            full[dk, :, :, di] += w * dist.T
    front = [np.array([k for k in range(d, n) if first_link[k] < d], dtype=np.int64) for d in range(n + 1)]
    push = [np.ascontiguousarray(full[d][:, :, front[d + 1]]) for d in range(n)]
    steps = [_frontier_step(front[d], front[d + 1], d) for d in range(n)]
    # Every item's times are its compute over the same speeds, so the unplaced item that raises
    # min_j (load_j + time_j) most is the one with the most compute: its row per depth.
    heaviest_after = [time[d + 1 + int(np.argmax(work[d + 1 :]))] if d + 1 < n else time[d] for d in range(n)]
    # Memory forces work: whatever size the other devices have no room for lands on device j, and the least
    # work that fills a size F is a fractional knapsack over the unplaced items, lowest work per byte first.
    knap = [_least_work_curve(work[d + 1 :], size[d + 1 :]) for d in range(n)]
    prev_in_class = [-1] * m
    for cls in identical_device_classes(c):
        for r in range(1, len(cls)):
            prev_in_class[cls[r]] = cls[r - 1]
    symmetric = any(p >= 0 for p in prev_in_class)
    eye_t = [np.diag(time[d]) for d in range(n)]  # (m, m): row j adds the item's time to device j
    eye_s = [np.eye(m) * size[d] for d in range(n)]
    alpha, beta = c.alpha, c.beta

    stack: list[_Block] = [
        (
            0,
            np.zeros((1, 0), dtype=np.int64),
            np.zeros((1, m)),
            np.zeros((1, m)),
            np.zeros(1),
            np.zeros((1, m, 0)),
            np.zeros((1, m), dtype=bool),
            np.zeros(1),
        )
    ]
    nodes = 0
    while stack:
        depth, prefix, loads, mem, comm, cross, used, lb = stack.pop()
        live = lb < _below(best)  # the incumbent may have improved since the block was pushed
        if not bool(live.all()):
            if not bool(live.any()):
                continue
            prefix, used = prefix[live], used[live]
            loads, mem, comm, cross = loads[live], mem[live], comm[live], cross[live]
        b = prefix.shape[0]
        nodes += b * m
        if nodes > node_budget:
            return BnbResult(best_a, best, False, nodes)
        # children: row r * m + j is parent r with the item at this depth on device j
        c_mem = (mem[:, None, :] + eye_s[depth][None]).reshape(b * m, m)
        room = cap - c_mem
        ok = _rows_all_nonneg(room)
        ok &= _row_sum(np.clip(room, 0.0, None)) >= rem_size[depth + 1] * (1 - 1e-12)
        if symmetric:
            allowed = np.ones((b, m), dtype=bool)
            for j, p in enumerate(prev_in_class):
                if p >= 0:
                    allowed[:, j] = used[:, p]
            ok &= allowed.reshape(b * m)
        if not bool(ok.any()):
            continue
        # every child is bounded by broadcasting over (parent, device); only the survivors are gathered
        c_loads = (loads[:, None, :] + eye_t[depth][None]).reshape(b * m, m)
        own, src, dst, same = steps[depth]
        gain = cross[:, :, own] if own >= 0 else np.zeros((b, m))  # the placed item's traffic, per device
        c_comm = (comm[:, None] + gain).reshape(-1)
        span = _row_max(c_loads)
        if depth + 1 == n:
            total = np.where(ok, alpha * span + beta * c_comm, math.inf)
            row = int(np.argmin(total))
            if float(total[row]) < _below(best):
                best = float(total[row])
                placed = [*prefix[row // m].tolist(), row % m]
                a = [0] * n
                for d, item in enumerate(order):
                    a[item] = placed[d]
                best_a = tuple(a)
            continue
        if same:
            inherit = cross[:, :, src]
        else:
            inherit = np.zeros((b, m, push[depth].shape[2]))
            inherit[:, :, dst] = cross[:, :, src]
        c_cross = inherit[:, None] + push[depth][None]  # (parent, device, device of a frontier item, item)
        if beta and c_cross.shape[3]:
            least = c_cross[:, :, 0].copy()
            for q in range(1, m):
                np.minimum(least, c_cross[:, :, q], out=least)
            bound = beta * (c_comm + least.reshape(b * m, -1) @ np.ones(least.shape[2]))
        else:
            bound = beta * c_comm
        span_lb = np.maximum(
            _span_floor(c_loads, spd, float(rem_work[depth + 1])),
            _row_min(c_loads + heaviest_after[depth]),
        )
        curve = knap[depth]
        if alpha and curve is not None:
            room = np.clip(room, 0.0, None)
            forced = np.clip(rem_size[depth + 1] - (_row_sum(room)[:, None] - room), 0.0, None)
            xs, ys = curve
            span_lb = np.maximum(span_lb, _row_max(c_loads + np.interp(forced, xs, ys) / spd))
        bound = np.where(ok, bound + alpha * span_lb, math.inf)
        sel = np.flatnonzero(bound < _below(best))
        if sel.size == 0:
            continue
        sel = sel[np.argsort(-bound[sel], kind="stable")]  # the lowest bounds are pushed last, popped first
        parent, dev = sel // m, sel % m
        c_prefix = np.concatenate([prefix[parent], dev[:, None]], axis=1)
        c_used = used[parent]
        c_used[np.arange(sel.size), dev] = True
        c_cross = c_cross.reshape(b * m, m, -1)[sel]
        for start in range(0, sel.size, _BLOCK):
            part = slice(start, start + _BLOCK)
            rows = sel[part]
            stack.append(
                (
                    depth + 1,
                    c_prefix[part],
                    c_loads[rows],
                    c_mem[rows],
                    c_comm[rows],
                    c_cross[part],
                    c_used[part],
                    bound[rows],
                )
            )
    return BnbResult(best_a, best, True, nodes)


def _frontier_step(
    here: npt.NDArray[np.int64], after: npt.NDArray[np.int64], depth: int
) -> tuple[int, npt.NDArray[np.int64] | slice, npt.NDArray[np.int64], bool]:
    """How a block's frontier columns at ``depth`` become its children's.

    Returns:
        ``(own, src, dst, same)``: the column of the item placed at ``depth`` (-1 if it has no traffic with
        the placed items), the columns ``src`` that carry over and their places ``dst`` among the children's
        columns, and whether they carry over as they are (``src`` then selects every child column in order).
    """
    where = {int(k): col for col, k in enumerate(here.tolist())}
    own = where.pop(depth, -1)
    later = {int(k): col for col, k in enumerate(after.tolist())}
    src = np.array(list(where.values()), dtype=np.int64)
    dst = np.array([later[k] for k in where], dtype=np.int64)
    if dst.size == after.size and bool((dst == np.arange(dst.size)).all()):
        start = int(src[0]) if src.size else 0
        if bool((src == np.arange(start, start + src.size)).all()):
            return own, slice(start, start + src.size), dst, True
        return own, src, dst, True
    return own, src, dst, False


def _below(best: float) -> float:
    """The value a bound must stay under to be worth expanding: the incumbent less rounding."""
    return best - abs(best) * 1e-12 if math.isfinite(best) else math.inf


def _least_work_curve(
    work: npt.NDArray[np.float64], size: npt.NDArray[np.float64]
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]] | None:
    """Breakpoints (cumulative size, cumulative work) of the least work that fills a size, or ``None``.

    Items of zero size are left out: they never help fill one, so the curve stays strictly increasing in size.
    """
    has = size > 0
    if not bool(has.any()):
        return None
    w, s = work[has], size[has]
    idx = np.argsort(w / s, kind="stable")
    xs = np.concatenate([[0.0], np.cumsum(s[idx])])
    ys = np.concatenate([[0.0], np.cumsum(w[idx])])
    return xs, ys


def _row_max(x: _F) -> _F:
    """``x.max(axis=1)`` for a (rows, m) array, as m - 1 elementwise maxima (faster for a short axis)."""
    out: _F = x[:, 0].copy()
    for j in range(1, x.shape[1]):
        np.maximum(out, x[:, j], out=out)
    return out


def _row_min(x: _F) -> _F:
    """``x.min(axis=1)`` for a (rows, m) array, as m - 1 elementwise minima."""
    out: _F = x[:, 0].copy()
    for j in range(1, x.shape[1]):
        np.minimum(out, x[:, j], out=out)
    return out


def _row_sum(x: _F) -> _F:
    """``x.sum(axis=1)`` for a (rows, m) array, as m - 1 elementwise additions."""
    out: _F = x[:, 0].copy()
    for j in range(1, x.shape[1]):
        out += x[:, j]
    return out


def _rows_all_nonneg(x: _F) -> _B:
    """``(x >= 0).all(axis=1)`` for a (rows, m) array."""
    out = x[:, 0] >= 0
    for j in range(1, x.shape[1]):
        out &= x[:, j] >= 0
    return out


def _span_floor(loads: _F, speeds: _F, work: float) -> _F:
    """Per row, ``max(largest load, water level)``: a makespan lower bound once ``work`` more is placed.

    The water level is the lowest T with ``f(T) = sum_j speeds[j] * max(0, T - loads[j]) >= work`` (compute
    divisible). Its maximum with the largest load L has a closed form: let ``A = (work + sum_j speeds[j] *
    loads[j]) / sum_j speeds[j]``, the level if every device were filled. If ``A >= L``, then ``f(A) = work``
    and ``f(T) < work`` for every ``T < A``, so the level is A. If ``A < L``, then ``f(L) = sum_j speeds[j] *
    (L - loads[j]) > work``, so the level is below L. Either way the maximum is ``max(L, A)``: two passes over
    the rows instead of a sort per row.
    """
    m = loads.shape[1]
    span = _row_max(loads)
    filled = np.full(loads.shape[0], work)
    for j in range(m):
        filled += float(speeds[j]) * loads[:, j]
    out: _F = np.maximum(span, filled / float(speeds.sum()))
    return out
