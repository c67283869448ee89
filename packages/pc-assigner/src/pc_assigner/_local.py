"""Local search for large problems: the steps of ``_heuristic.local_search``, priced with numpy.

The steps, their order and the acceptance rule are those of the pure-Python search (first improvement: moves
over items then devices, then swaps over pairs ``i < k``; a step is taken when it lowers the cost, or keeps it
and lowers the sum of squared device times). What changes is the price of a candidate:

* ``G[x, j]``, the traffic cost of item x's edges if x sat on device j (the others where they are), is kept
  up to date (O(degree * m) per accepted step), so a move costs ``G[i, dst] - G[i, src]`` in O(1);
* the swaps of item i with every ``k > i`` are priced together as numpy vectors: the change of traffic is
  ``G[i, a_k] - G[i, a_i] + G[k, a_i] - G[k, a_k]`` plus, for an edge between i and k, the correction
  ``(W[i, k] + W[k, i]) * (D[a_i][a_k] + D[a_k][a_i] - D[a_i][a_i] - D[a_k][a_k])`` (both G terms assumed the
  other end stayed put). The first improving k is taken, and the scan goes on after it with the new state,
  exactly as the sequential loop would.

Candidates are priced a block of rows at a time (items i for moves, pairs (i, k) for swaps), and the first
improving one in the sequential order is taken; after a step the scan resumes right after it with a block of
8 rows, and the block doubles (to 64 rows) while none improves. So a pass costs O(n / 64 + steps) vector
operations over up to 64 x n candidates instead of n^2 / 2 Python steps. Rounding can differ from
the pure-Python sums in the last bits, so the two may part ways at an exact tie; each is deterministic.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pc_assigner._core import Compiled
from pc_assigner.problem import _MEMORY_RTOL

__all__ = ["VECTOR_MIN_N", "vector_local_search"]

VECTOR_MIN_N = 64
"""Items from which :func:`~pc_assigner._heuristic.local_search` prices its steps with numpy (below it the
pure-Python loop is faster: the vectors are too short to pay for numpy's per-call cost)."""

_MAX_PASSES = 200  # as in _heuristic: a safety bound
_MAX_BLOCK = 64  # rows of candidates priced together while none improves
_RESUME_BLOCK = 8  # rows priced after a step (a call's fixed cost outweighs a few rows' candidates)

_F = npt.NDArray[np.float64]
_I = npt.NDArray[np.int64]
_B = npt.NDArray[np.bool_]


class _Search:
    """The state of one local search: assignment, device times and memory, traffic table ``G``."""

    def __init__(self, c: Compiled, a: list[int]) -> None:
        n, m = c.n, c.m
        self.n, self.m, self.alpha, self.beta = n, m, c.alpha, c.beta
        self.time = np.array(c.time, dtype=np.float64).reshape(n, m)
        self.size = np.array(c.size, dtype=np.float64)
        room = np.array(c.cap, dtype=np.float64)
        self.room = room + np.abs(room) * _MEMORY_RTOL  # problem.fits
        self.dist = dist = np.array(c.dist, dtype=np.float64).reshape(m, m)
        diag = np.diag(dist)
        self.sym = dist + dist.T - diag[:, None] - diag[None, :]  # the swap correction per device pair
        out: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        inn: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        pair: list[dict[int, float]] = [{} for _ in range(n)]
        for i, k, w in c.edges:
            out[i].append((k, w))
            inn[k].append((i, w))
            pair[i][k] = pair[i].get(k, 0.0) + w
            pair[k][i] = pair[k].get(i, 0.0) + w
        self.out = [_arrays(e) for e in out]
        self.inn = [_arrays(e) for e in inn]
        # W[i, k] + W[k, i] in compressed rows: row r is pair_k[ptr[r]:ptr[r + 1]]
        self.ptr = np.cumsum([0] + [len(d) for d in pair])
        self.pair_k = np.array([k for d in pair for k in d], dtype=np.int64)
        self.pair_w = np.array([w for d in pair for w in d.values()], dtype=np.float64)
        self.pair_row = np.repeat(np.arange(n), np.diff(self.ptr))
        self.asg = asg = np.array(a, dtype=np.int64)
        self.rows = np.arange(n)
        self.loads = np.zeros(m)
        self.mem = np.zeros(m)
        np.add.at(self.loads, asg, self.time[self.rows, asg])
        np.add.at(self.mem, asg, self.size)
        self.g = np.zeros((n, m))  # G[x, j]: traffic cost of x's edges with x on j, the others staying
        for i, k, w in c.edges:
            self.g[i] += w * dist[:, asg[k]]
            self.g[k] += w * dist[asg[i], :]
        self.comm = float(sum(w * dist[asg[i], asg[k]] for i, k, w in c.edges))
        self.devices = np.arange(m)

    def move(self, x: int, dst: int) -> None:
        """Put item x on ``dst``, updating times, memory and the traffic table (not ``comm``)."""
        src = int(self.asg[x])
        self.loads[src] -= self.time[x, src]
        self.loads[dst] += self.time[x, dst]
        self.mem[src] -= self.size[x]
        self.mem[dst] += self.size[x]
        self.asg[x] = dst
        k_out, w = self.out[x]
        if k_out.size:  # k receives from x: its cost w * D[a_x][j]
            self.g[k_out] += w * (self.dist[dst] - self.dist[src])[None, :]
        k_in, w = self.inn[x]
        if k_in.size:  # k sends to x: its cost w * D[j][a_x]
            self.g[k_in] += w * (self.dist[:, dst] - self.dist[:, src])[None, :]

    def rest(self) -> _F:
        """``rest[x, y]``: the largest device time among devices other than x and y (0 when none)."""
        loads = self.loads.tolist()
        top = sorted(range(self.m), key=loads.__getitem__, reverse=True)[:3]
        table = [
            [next((loads[j] for j in top if j != x and j != y), 0.0) for y in range(self.m)]
            for x in range(self.m)
        ]
        return np.array(table)

    def better(self, new_cost: _F, dsq: _F, cost: float) -> _B:
        """A lower cost, or the same cost and a lower sum of squared loads (by more than rounding)."""
        tie = -1e-12 * float((self.loads * self.loads).sum())
        lower: _B = (new_cost < cost - abs(cost) * 1e-12) | ((new_cost <= cost) & (dsq < tie))
        return lower

    def moves(self, i: int, d0: int, block: int, cost: float) -> tuple[_B, _F, _F]:
        """Improving moves of items ``i .. i + block - 1`` (devices >= d0 for item i).

        Returns:
            The mask of improving moves, their costs and their changes of traffic, (rows, devices).
        """
        r = self.rows[i : i + block]
        src = self.asg[r]
        loads, time = self.loads, self.time
        ls = (loads[src] - time[r, src])[:, None]
        ld = loads[None, :] + time[r]
        new_cost = self.alpha * np.maximum(np.maximum(ls, ld), self.rest()[src])
        dcomm = self.g[r] - self.g[r, src][:, None]
        if self.beta:
            new_cost = new_cost + self.beta * (self.comm + dcomm)
        dsq = ls * ls + ld * ld - (loads[src] ** 2)[:, None] - (loads**2)[None, :]
        ok = (self.devices[None, :] != src[:, None]) & (
            self.mem[None, :] + self.size[r][:, None] <= self.room
        )
        ok[0, :d0] = False
        ok &= self.better(new_cost, dsq, cost)
        return ok, new_cost, dcomm

    def swaps(self, i: int, k0: int, block: int, cost: float) -> tuple[_B, _F, _F]:
        """Improving swaps (r, k), k > r, of rows ``i .. i + block - 1`` (k >= k0 in row i)."""
        r = self.rows[i : i + block]
        asg, loads, time, g, rows = self.asg, self.loads, self.time, self.g, self.rows
        ji = asg[r]
        li = loads[ji][:, None] + time[:, ji].T - time[r, ji][:, None]  # r's device, with k there
        lk = loads[asg][None, :] + time[r][:, asg] - time[rows, asg][None, :]
        new_cost = self.alpha * np.maximum(np.maximum(li, lk), self.rest()[ji][:, asg])
        dcomm = np.zeros(li.shape)
        if self.beta:
            lo, hi = int(self.ptr[i]), int(self.ptr[i + r.size])
            pair = np.zeros(li.shape)  # W[r, k] + W[k, r]
            pair[self.pair_row[lo:hi] - i, self.pair_k[lo:hi]] = self.pair_w[lo:hi]
            g_r = g[r]
            dcomm = g_r[:, asg] - g_r[np.arange(r.size), ji][:, None] + g[:, ji].T - g[rows, asg][None, :]
            dcomm += pair * self.sym[ji][:, asg]
            new_cost = new_cost + self.beta * (self.comm + dcomm)
        dsq = li * li + lk * lk - (loads[ji] ** 2)[:, None] - (loads[asg] ** 2)[None, :]
        ok = (asg[None, :] != ji[:, None]) & (rows[None, :] > r[:, None])
        ok[0, :k0] = False
        ok &= (self.mem[ji] - self.size[r])[:, None] + self.size[None, :] <= self.room[ji][:, None]
        ok &= (self.mem[asg] - self.size)[None, :] + self.size[r][:, None] <= self.room[asg][None, :]
        ok &= self.better(new_cost, dsq, cost)
        return ok, new_cost, dcomm


def _arrays(edges: list[tuple[int, float]]) -> tuple[_I, _F]:
    return np.array([k for k, _ in edges], dtype=np.int64), np.array([w for _, w in edges])[:, None]


def vector_local_search(c: Compiled, a: list[int]) -> list[int]:
    """First-improvement moves and swaps from a feasible ``a`` until no step improves; returns a new list."""
    s = _Search(c, a)
    n = s.n
    for _ in range(_MAX_PASSES):
        cost = s.alpha * float(s.loads.max()) + s.beta * s.comm
        improved = False
        for swaps in (False, True):
            i, col, block = 0, (1 if swaps else 0), 1
            while i < (n - 1 if swaps else n):
                ok, new_cost, dcomm = (s.swaps if swaps else s.moves)(i, col, block, cost)
                flat = ok.reshape(-1)
                hit = int(flat.argmax())
                if not flat[hit]:  # nothing improves in these rows: on to the next, more at once
                    i, col, block = i + ok.shape[0], 0, min(2 * block, _MAX_BLOCK)
                    continue
                t, col = divmod(hit, ok.shape[1])
                r = i + t
                if swaps:
                    jr = int(s.asg[r])
                    s.move(r, int(s.asg[col]))
                    s.move(col, jr)
                else:
                    s.move(r, col)
                s.comm += float(dcomm[t, col]) if s.beta else 0.0
                cost, improved = float(new_cost[t, col]), True
                i, col, block = r, col + 1, _RESUME_BLOCK  # resume right after the step, as in the loop
        if not improved:
            break
    return [int(j) for j in s.asg]
