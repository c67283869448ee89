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

__all__ = ["IlpResult", "ilp_available", "ilp_search"]


@dataclass(frozen=True)
class IlpResult:
    """Outcome of one ILP solve.

    Attributes:
        assignment: Best placement over eligible devices, or ``None``.
        proven: ``True`` when HiGHS proved optimality (or infeasibility when ``assignment`` is ``None``).
        message: HiGHS's status message.
    """

    assignment: tuple[int, ...] | None
    proven: bool
    message: str


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


def ilp_search(c: Compiled, *, time_limit: float = 30.0) -> IlpResult:
    """Solve ``c`` exactly with HiGHS within ``time_limit`` seconds.

    Raises:
        ImportError: if scipy is not installed.
    """
    np, bounds_cls, constraint_cls, milp, coo_array = _import()
    n, m = c.n, c.m
    if n == 0:
        return IlpResult((), True, "empty")
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
    integrality = np.zeros(nvar)
    integrality[:nx] = 1
    lb = np.zeros(nvar)
    ub = np.full(nvar, math.inf)
    ub[:nx] = 1.0
    res = milp(
        obj,
        constraints=constraint_cls(a_mat, np.array(lo), np.array(hi)),
        integrality=integrality,
        bounds=bounds_cls(lb, ub),
        options={"time_limit": float(time_limit), "disp": False},
    )
    if res.x is None:
        return IlpResult(None, res.status == 2, str(res.message))
    x = np.asarray(res.x[:nx]).reshape(n, m)
    assignment = tuple(int(j) for j in x.argmax(axis=1))
    return IlpResult(assignment, res.status == 0, str(res.message))
