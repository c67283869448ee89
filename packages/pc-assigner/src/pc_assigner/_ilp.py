"""Mixed-integer formulation solved by HiGHS through ``scipy.optimize.milp`` (imported lazily).

Variables: binary ``x[i, j]`` (item i on device j), the makespan ``T``, and for every edge (i, k) with traffic
and device pair (j, l) with positive distance a continuous ``y >= x[i, j] + x[k, l] - 1`` (so ``y = 1``
exactly when the edge crosses j -> l, because y has a positive cost). Minimise ``alpha * T + beta * sum w * D
* y`` subject to one device per item, ``sum_i time[i][j] x[i, j] <= T`` and ``sum_i size[i] x[i, j] <=
cap[j]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pc_assigner._core import Compiled

__all__ = ["IlpResult", "ilp_available", "ilp_search", "lp_lower_bound", "lp_relaxation"]


@dataclass(frozen=True)
class IlpResult:
    """Outcome of one ILP solve.

    Attributes:
        assignment: Best placement over eligible devices, or ``None``.
        proven: ``True`` when HiGHS proved optimality within ``mip_rel_gap`` (or infeasibility when
            ``assignment`` is ``None``).
        message: HiGHS's status message.
        bound: HiGHS's proven lower bound on the optimal cost (its dual bound), or ``None`` when it gave none.
    """

    assignment: tuple[int, ...] | None
    proven: bool
    message: str
    bound: float | None = None


def ilp_available() -> bool:
    """Whether scipy with ``optimize.milp`` can be imported."""
    try:
        from scipy.optimize import milp  # noqa: F401
    except ImportError:
        return False
    return True


def _import() -> Any:
    try:
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_array
    except ImportError as exc:
        raise ImportError(
            'method="ilp" needs scipy>=1.9; install it with: pip install "pc-assigner[solver]"'
        ) from exc
    return np, Bounds, LinearConstraint, milp, coo_array


def _model(c: Compiled) -> tuple[Any, Any, Any, Any, int]:
    """The objective, constraint matrix and row bounds of the formulation, and the number of x variables."""
    np, _, _, _, coo_array = _import()
    n, m = c.n, c.m
    nx = n * m
    pairs = [(j, q) for j in range(m) for q in range(m) if c.dist[j][q] > 0] if c.beta else []
    ys = [(e, j, q) for e in range(len(c.edges)) for j, q in pairs]
    nvar = nx + 1 + len(ys)
    t_idx = nx
    obj = np.zeros(nvar)
    obj[t_idx] = c.alpha
    for v, (e, j, q) in enumerate(ys):
        obj[nx + 1 + v] = c.beta * c.edges[e][2] * c.dist[j][q]

    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lo: list[float] = []
    hi: list[float] = []
    r = 0
    for i in range(n):  # one device per item
        for j in range(m):
            rows.append(r)
            cols.append(i * m + j)
            vals.append(1.0)
        lo.append(1.0)
        hi.append(1.0)
        r += 1
    for j in range(m):  # time_j <= T
        for i in range(n):
            if c.time[i][j]:
                rows.append(r)
                cols.append(i * m + j)
                vals.append(c.time[i][j])
        rows.append(r)
        cols.append(t_idx)
        vals.append(-1.0)
        lo.append(-math.inf)
        hi.append(0.0)
        r += 1
    scale = max([s for s in c.size if s > 0], default=1.0)  # keep HiGHS's coefficients near 1
    for j in range(m):  # memory
        if math.isinf(c.cap[j]):
            continue
        for i in range(n):
            if c.size[i]:
                rows.append(r)
                cols.append(i * m + j)
                vals.append(c.size[i] / scale)
        lo.append(-math.inf)
        hi.append(c.cap[j] / scale * (1 + 1e-12))
        r += 1
    for v, (e, j, q) in enumerate(ys):  # y - x[i,j] - x[k,q] >= -1
        i, k, _ = c.edges[e]
        rows += [r, r, r]
        cols += [nx + 1 + v, i * m + j, k * m + q]
        vals += [1.0, -1.0, -1.0]
        lo.append(-1.0)
        hi.append(math.inf)
        r += 1
    a_mat = coo_array((vals, (rows, cols)), shape=(r, nvar)).tocsr()
    return obj, a_mat, np.array(lo), np.array(hi), nx


def ilp_search(c: Compiled, *, time_limit: float = 30.0, mip_rel_gap: float | None = None) -> IlpResult:
    """Solve ``c`` exactly with HiGHS within ``time_limit`` seconds.

    Args:
        c: The compiled problem.
        time_limit: Seconds HiGHS may run.
        mip_rel_gap: Relative gap at which HiGHS stops and calls the placement optimal (HiGHS's default,
            1e-4, when ``None``).

    Raises:
        ImportError: if scipy is not installed.
    """
    np, bounds_cls, constraint_cls, milp, _ = _import()
    n, m = c.n, c.m
    if n == 0:
        return IlpResult((), True, "empty", 0.0)
    obj, a_mat, lo, hi, nx = _model(c)
    nvar = len(obj)
    integrality = np.zeros(nvar)
    integrality[:nx] = 1
    lb = np.zeros(nvar)
    ub = np.full(nvar, math.inf)
    ub[:nx] = 1.0
    options: dict[str, Any] = {"time_limit": float(time_limit), "disp": False}
    if mip_rel_gap is not None:
        options["mip_rel_gap"] = float(mip_rel_gap)
    res = milp(
        obj,
        constraints=constraint_cls(a_mat, lo, hi),
        integrality=integrality,
        bounds=bounds_cls(lb, ub),
        options=options,
    )
    dual = getattr(res, "mip_dual_bound", None)
    bound = float(dual) if dual is not None and math.isfinite(float(dual)) else None
    if res.x is None:
        return IlpResult(None, res.status == 2, str(res.message), bound)
    x = np.asarray(res.x[:nx]).reshape(n, m)
    assignment = tuple(int(j) for j in x.argmax(axis=1))
    return IlpResult(assignment, res.status == 0, str(res.message), bound)


def lp_lower_bound(c: Compiled) -> float:
    """The optimum of the LP relaxation (``0 <= x <= 1``): a lower bound on every placement's cost.

    It is weak where communication matters (a fractional item split evenly over devices "crosses" no edge), so
    on most instances it bounds the makespan term only; it proves nothing better than that.
    :func:`pc_assigner._bound.hub_lower_bound` charges traffic.

    Raises:
        ImportError: if scipy is not installed.
        ValueError: if the relaxation is infeasible (then no placement fits either).
    """
    value = lp_relaxation(c)
    if value is None:
        raise ValueError("the LP relaxation has no optimum: it is infeasible")
    return value


def lp_relaxation(c: Compiled, fixed: dict[int, int] | None = None) -> float | None:
    """The optimum of the LP relaxation with the items of ``fixed`` placed on their devices (integrally).

    Every placement that puts the items of ``fixed`` where it says is a feasible point of this LP, with its
    cost as the LP's objective; so the value is a lower bound on the cost of every such placement.

    Returns:
        The LP's optimum, or ``None`` when it is infeasible (then no such placement fits either).

    Raises:
        ImportError: if scipy is not installed.
        ValueError: if HiGHS stops for another reason than optimality or infeasibility.
    """
    np, _, _, _, _ = _import()
    from scipy.optimize import linprog
    from scipy.sparse import vstack

    if c.n == 0:
        return 0.0
    obj, a_mat, lo, hi, nx = _model(c)
    nvar = len(obj)
    lb = np.zeros(nvar)
    ub = np.full(nvar, math.inf)
    ub[:nx] = 1.0
    for i, j in (fixed or {}).items():
        ub[i * c.m : (i + 1) * c.m] = 0.0
        lb[i * c.m + j] = ub[i * c.m + j] = 1.0
    finite_hi = np.isfinite(hi)
    finite_lo = np.isfinite(lo)
    eq = finite_hi & finite_lo & (lo == hi)
    upper = finite_hi & ~eq
    lower = finite_lo & ~eq
    a_ub = vstack([a_mat[upper], -a_mat[lower]]).tocsr()
    b_ub = np.concatenate([hi[upper], -lo[lower]])
    res = linprog(
        obj,
        A_ub=a_ub,
        b_ub=b_ub,
        A_eq=a_mat[eq],
        b_eq=hi[eq],
        bounds=list(zip(lb, ub, strict=True)),
        method="highs",
    )
    if res.status == 2:
        return None
    if res.status != 0:
        raise ValueError(f"the LP relaxation stopped without an optimum: {res.message}")
    return float(res.fun)
