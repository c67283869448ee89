"""Exhaustive search, vectorised with torch, for problems with at most about a million placements.

Items are split into a *prefix* (the first ``n - n_lo`` items, enumerated in Python) and a *suffix* (the last
``n_lo`` items, whose ``m ** n_lo`` placements form one precomputed table)::

    prefix placements (H, canonical only) ──┐
                                            ├─ memory  = mem_hi[h] + mem_lo[l]        (B, L, m)  -> mask first
    suffix table (L = m ** n_lo rows) ──────┤  time    = time_hi[h] + time_lo[l]      (B, L, m)  -> max
                                            └─ traffic = comm_hi[h] + comm_lo[l] + V[h] @ onehot_lo[l]^T

``V[h]`` folds every edge between a prefix item and a suffix item into one vector per prefix, so the cross
traffic of a whole block is a single matrix product. Placements are numbered with item 0 as the most
significant digit, so the first minimum is the lexicographically smallest optimal placement. Interchangeable
devices are canonicalised on the prefix (a device of a class is used only after the class's lower ones), which
keeps the lexicographically smallest member of every symmetric orbit.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from pc_assigner._core import Compiled, identical_device_classes

__all__ = ["EXACT_LIMIT", "exact_search", "search_space"]

EXACT_LIMIT = 10_000_000
"""Largest ``m ** n`` that ``method="exact"`` accepts."""

_SUFFIX_ROWS = 8192  # rows of the suffix table
_BLOCK = 1 << 17  # placements evaluated per tensor block


def search_space(n: int, m: int) -> int:
    """``m ** n``, the number of placements of n items on m devices."""
    return int(m**n)


def _canonical_prefixes(n_hi: int, m: int, classes: list[list[int]]) -> Iterator[tuple[int, ...]]:
    """Prefixes in lexicographic order in which each class's devices are first used in increasing order."""
    prev_in_class: dict[int, int] = {}
    for cls in classes:
        for r in range(1, len(cls)):
            prev_in_class[cls[r]] = cls[r - 1]
    prefix: list[int] = []
    used = [False] * m

    def rec(depth: int) -> Iterator[tuple[int, ...]]:
        if depth == n_hi:
            yield tuple(prefix)
            return
        for j in range(m):
            p = prev_in_class.get(j)
            if p is not None and not used[p]:
                continue
            was = used[j]
            used[j] = True
            prefix.append(j)
            yield from rec(depth + 1)
            prefix.pop()
            used[j] = was

    yield from rec(0)


def _digits(count: int, width: int, m: int) -> torch.Tensor:
    """All ``m ** width`` digit rows (most significant first) as a (count, width) long tensor."""
    idx = torch.arange(count, dtype=torch.long)
    cols = [(idx // (m ** (width - 1 - t))) % m for t in range(width)]
    return torch.stack(cols, dim=1) if cols else torch.zeros((count, 0), dtype=torch.long)


def _per_device(digits: torch.Tensor, values: torch.Tensor, m: int) -> torch.Tensor:
    """``out[r, j] = sum_t values[t, digits[r, t]] * [digits[r, t] == j]`` (values is (width, m))."""
    rows, width = digits.shape
    out = torch.zeros((rows, m), dtype=torch.float64)
    if width:
        picked = values[torch.arange(width).unsqueeze(0), digits]  # (rows, width)
        out.scatter_add_(1, digits, picked)
    return out


def exact_search(c: Compiled) -> tuple[tuple[int, ...], float] | None:
    """The optimal feasible placement of ``c`` (lexicographically smallest among ties) and its cost.

    Returns:
        ``(assignment over eligible devices, cost)``, or ``None`` when no placement fits (a proof of
        infeasibility).
    """
    n, m = c.n, c.m
    if n == 0:
        return (), 0.0
    n_lo = min(n, max(1, int(math.log(_SUFFIX_ROWS) / math.log(m)))) if m > 1 else n
    n_hi = n - n_lo
    f64 = torch.float64
    time_t = torch.tensor(c.time, dtype=f64)  # (n, m)
    size_t = torch.tensor(c.size, dtype=f64).unsqueeze(1).expand(n, m)
    dist = torch.tensor(c.dist, dtype=f64)
    cap = torch.tensor(c.cap, dtype=f64)
    cap = cap + cap.abs() * 1e-12  # same slack as problem.fits

    rows = m**n_lo
    lo = _digits(rows, n_lo, m)
    lo_time = _per_device(lo, time_t[n_hi:], m)
    lo_mem = _per_device(lo, size_t[n_hi:], m)
    onehot = torch.nn.functional.one_hot(lo, m).to(f64).reshape(rows, n_lo * m)
    lo_comm = torch.zeros(rows, dtype=f64)
    for i, k, w in c.edges:
        if i >= n_hi and k >= n_hi:
            lo_comm += w * dist[lo[:, i - n_hi], lo[:, k - n_hi]]

    prefixes = list(_canonical_prefixes(n_hi, m, identical_device_classes(c)))
    hi = torch.tensor(prefixes, dtype=torch.long).reshape(len(prefixes), n_hi)
    hi_time = _per_device(hi, time_t[:n_hi], m)
    hi_mem = _per_device(hi, size_t[:n_hi], m)
    hi_comm = torch.zeros(len(prefixes), dtype=f64)
    cross = torch.zeros((len(prefixes), n_lo * m), dtype=f64)
    for i, k, w in c.edges:
        if i < n_hi and k < n_hi:
            hi_comm += w * dist[hi[:, i], hi[:, k]]
        elif i < n_hi:  # prefix item sends to suffix item k
            t = k - n_hi
            cross[:, t * m : (t + 1) * m] += w * dist[hi[:, i]]
        elif k < n_hi:  # suffix item i sends to prefix item k
            t = i - n_hi
            cross[:, t * m : (t + 1) * m] += w * dist[:, hi[:, k]].T

    best: tuple[float, int, int] | None = None  # (cost, prefix index, suffix row)
    per_block = max(1, _BLOCK // rows)
    for start in range(0, len(prefixes), per_block):
        sl = slice(start, start + per_block)
        mem = hi_mem[sl, None, :] + lo_mem[None, :, :]
        feasible = (mem <= cap).all(dim=-1)
        if not bool(feasible.any()):
            continue
        cost = torch.zeros(feasible.shape, dtype=f64)
        if c.alpha:
            cost += c.alpha * (hi_time[sl, None, :] + lo_time[None, :, :]).amax(dim=-1)
        if c.beta and c.edges:
            comm = hi_comm[sl, None] + lo_comm[None, :] + cross[sl] @ onehot.T
            cost += c.beta * comm
        cost = cost.masked_fill(~feasible, math.inf)
        value = float(cost.min())
        tol = abs(value) * 1e-12
        if best is not None and value >= best[0] - tol:
            continue
        flat = int(torch.nonzero((cost <= value + tol).reshape(-1))[0])
        best = (value, start + flat // rows, flat % rows)
    if best is None:
        return None
    value, h, r = best
    return tuple(prefixes[h]) + tuple(int(x) for x in lo[r].tolist()), value
