"""The placement problem as plain data: what every solver is judged by.

A :class:`PlacementProblem` holds n items (modules, or groups of modules that share storage) and m devices:

* ``sizes[i]`` and ``capacities[j]`` are memory in any one unit (bytes, MiB, ...). Memory is a **hard**
  constraint: a placement is feasible iff ``sum(sizes[i] for i on j) <= capacities[j]`` for every device j.
* ``compute[i]`` is work (FLOPs, or any proxy) and ``speeds[j]`` relative throughput; item i takes
  ``compute[i] / speeds[j]`` on device j.
* ``traffic[(i, k)]`` is the data sent from item i to item k per step; ``distance[j][l]`` the cost of moving
  one unit from device j to device l (zero on the diagonal).

The cost of a placement ``a`` (``a[i]`` is the device index of item i) is::

    cost(a) = alpha * max_j sum_{a(i)=j} compute[i] / speeds[j]
            + beta  * sum_{(i,k)} traffic[i,k] * distance[a(i)][a(k)]

A device of speed 0 never computes: it is left out whenever some device has a positive speed. When every
speed is 0 they are all treated as equal (1.0). Memory only enters the constraints, so scaling sizes and
capacities by the same factor changes no result.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PlacementCost", "PlacementProblem", "placement_cost"]

# Memory sums of the same items may be computed in different orders by different solvers; this relative slack
# keeps them in agreement at an exact boundary. It is far below one byte for any real device.
_MEMORY_RTOL = 1e-12


def fits(load: float, capacity: float) -> bool:
    """Whether a memory ``load`` fits into ``capacity`` (with a relative slack of 1e-12 for rounding)."""
    return load <= capacity + abs(capacity) * _MEMORY_RTOL


def _floats(name: str, values: Any, *, allow_inf: bool = False) -> tuple[float, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of numbers, got {type(values).__name__}")
    out: list[float] = []
    for idx, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{name}[{idx}] must be a number, got {type(v).__name__} ({v!r})")
        f = float(v)
        if math.isnan(f) or f < 0 or (math.isinf(f) and not allow_inf):
            expected = "a non-negative number" + (" (inf allowed)" if allow_inf else ", finite")
            raise ValueError(f"{name}[{idx}] must be {expected}, got {v!r}")
        out.append(f)
    return tuple(out)


def _weight(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
    f = float(value)
    if not math.isfinite(f) or f < 0:
        raise ValueError(f"{name} must be a finite non-negative number, got {value!r}")
    return f


def normalize_traffic(traffic: Any, n: int, *, name: str = "traffic") -> tuple[tuple[int, int, float], ...]:
    """Validate a ``{(i, k): w}`` mapping against ``n`` items and return sorted ``(i, k, w)`` with ``w > 0``.

    Raises:
        TypeError: if ``traffic`` is not a mapping, a key is not a pair of ints or a weight not a number.
        ValueError: if an index is out of ``range(n)``, ``i == k``, or a weight is negative or not finite.
    """
    if not isinstance(traffic, Mapping):
        raise TypeError(f"{name} must be a mapping {{(i, k): weight}}, got {type(traffic).__name__}")
    edges: list[tuple[int, int, float]] = []
    for key, w in traffic.items():
        if (
            not isinstance(key, tuple)
            or len(key) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in key)
        ):
            raise TypeError(f"{name} keys must be (int, int) pairs, got {key!r}")
        i, k = key
        if not (0 <= i < n and 0 <= k < n):
            raise ValueError(
                f"{name} key {key!r} is out of range: indices must be in [0, {n}) for {n} models"
            )
        if i == k:
            raise ValueError(f"{name} key {key!r} connects a model to itself; expected i != k")
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            raise TypeError(f"{name}[{key!r}] must be a number, got {type(w).__name__} ({w!r})")
        wf = float(w)
        if not math.isfinite(wf) or wf < 0:
            raise ValueError(f"{name}[{key!r}] must be a finite non-negative number, got {w!r}")
        if wf > 0:
            edges.append((i, k, wf))
    edges.sort()
    return tuple(edges)


@dataclass(frozen=True)
class PlacementProblem:
    """A validated, immutable placement instance (see the module docstring for the cost model).

    Sequences are converted to tuples of floats and ``traffic`` to sorted ``(i, k, w)`` triples with ``w > 0``
    on construction, so equal inputs give equal (and hashable) problems.

    Attributes:
        sizes: Memory of each item (any unit, the same as ``capacities``).
        compute: Work of each item (any unit).
        capacities: Memory each device may hold (``inf`` allowed).
        speeds: Relative throughput of each device (0 = never compute there).
        distance: ``m x m`` cost of moving one unit of traffic between devices; zero diagonal.
        traffic: ``{(i, k): w}`` on input; stored as sorted ``(i, k, w)`` triples.
        alpha: Weight of the makespan term.
        beta: Weight of the communication term.

    Examples:
        >>> p = PlacementProblem(sizes=[1, 1], compute=[1, 1], capacities=[2, 2], speeds=[1, 1],
        ...                      distance=[[0, 1], [1, 0]], traffic={(0, 1): 0.5})
        >>> placement_cost(p, [0, 1]).total
        1.5
    """

    sizes: tuple[float, ...]
    compute: tuple[float, ...]
    capacities: tuple[float, ...]
    speeds: tuple[float, ...]
    distance: tuple[tuple[float, ...], ...]
    traffic: tuple[tuple[int, int, float], ...] = ()
    alpha: float = 1.0
    beta: float = 1.0

    def __post_init__(self) -> None:
        sizes = _floats("sizes", self.sizes)
        compute = _floats("compute", self.compute)
        caps = _floats("capacities", self.capacities, allow_inf=True)
        speeds = _floats("speeds", self.speeds)
        if len(sizes) != len(compute):
            raise ValueError(
                f"sizes and compute must have one entry per item, got {len(sizes)} and {len(compute)}"
            )
        if not caps:
            raise ValueError("at least one device is needed, got capacities=()")
        if len(speeds) != len(caps):
            raise ValueError(f"speeds must have one entry per device ({len(caps)}), got {len(speeds)}")
        raw_dist: Any = self.distance
        if isinstance(raw_dist, (str, bytes)) or not isinstance(raw_dist, Sequence):
            raise TypeError(f"distance must be an m x m sequence of rows, got {type(self.distance).__name__}")
        if len(self.distance) != len(caps):
            raise ValueError(
                f"distance must have {len(caps)} rows (one per device), got {len(self.distance)}"
            )
        dist = tuple(_floats(f"distance[{j}]", row) for j, row in enumerate(self.distance))
        for j, row in enumerate(dist):
            if len(row) != len(caps):
                raise ValueError(f"distance[{j}] must have {len(caps)} entries, got {len(row)}")
            if row[j] != 0:
                raise ValueError(f"distance[{j}][{j}] must be 0 (a device to itself), got {row[j]!r}")
        raw = self.traffic
        if isinstance(raw, Mapping):
            edges = normalize_traffic(raw, len(sizes))
        else:
            edges = normalize_traffic({(int(i), int(k)): w for i, k, w in raw}, len(sizes))
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "compute", compute)
        object.__setattr__(self, "capacities", caps)
        object.__setattr__(self, "speeds", speeds)
        object.__setattr__(self, "distance", dist)
        object.__setattr__(self, "traffic", edges)
        object.__setattr__(self, "alpha", _weight("alpha", self.alpha))
        object.__setattr__(self, "beta", _weight("beta", self.beta))

    @property
    def n(self) -> int:
        """Number of items."""
        return len(self.sizes)

    @property
    def m(self) -> int:
        """Number of devices."""
        return len(self.capacities)

    @property
    def eligible(self) -> tuple[int, ...]:
        """Indices of the devices items may go to: speed > 0, or all of them when every speed is 0."""
        pos = tuple(j for j, p in enumerate(self.speeds) if p > 0)
        return pos if pos else tuple(range(self.m))

    @property
    def effective_speeds(self) -> tuple[float, ...]:
        """``speeds``, with all-zero speeds replaced by 1.0 each."""
        return self.speeds if any(p > 0 for p in self.speeds) else tuple(1.0 for _ in self.speeds)

    def scaled_memory(self, factor: float) -> PlacementProblem:
        """The same problem with sizes and capacities multiplied by ``factor`` (unit-invariance checks)."""
        if not factor > 0 or not math.isfinite(factor):
            raise ValueError(f"factor must be a finite positive number, got {factor!r}")
        return PlacementProblem(
            sizes=tuple(s * factor for s in self.sizes),
            compute=self.compute,
            capacities=tuple(c * factor for c in self.capacities),
            speeds=self.speeds,
            distance=self.distance,
            traffic=self.traffic,
            alpha=self.alpha,
            beta=self.beta,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``inf`` capacities become the string ``"inf"``)."""
        return {
            "sizes": list(self.sizes),
            "compute": list(self.compute),
            "capacities": [c if math.isfinite(c) else "inf" for c in self.capacities],
            "speeds": list(self.speeds),
            "distance": [list(r) for r in self.distance],
            "traffic": [[i, k, w] for i, k, w in self.traffic],
            "alpha": self.alpha,
            "beta": self.beta,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlacementProblem:
        """Inverse of :meth:`to_dict`."""
        return cls(
            sizes=tuple(data["sizes"]),
            compute=tuple(data["compute"]),
            capacities=tuple(math.inf if c == "inf" else c for c in data["capacities"]),
            speeds=tuple(data["speeds"]),
            distance=tuple(tuple(r) for r in data["distance"]),
            traffic=tuple((int(i), int(k), float(w)) for i, k, w in data["traffic"]),
            alpha=data.get("alpha", 1.0),
            beta=data.get("beta", 1.0),
        )


@dataclass(frozen=True)
class PlacementCost:
    """The cost breakdown of one placement.

    Attributes:
        makespan: Compute time of the slowest device (``inf`` if work lands on a device of speed 0).
        communication: ``sum traffic[i, k] * distance[a(i)][a(k)]``.
        total: ``alpha * makespan + beta * communication`` (a zero weight drops its term).
        memory: Memory placed on each device.
        feasible: Whether every device's memory fits its capacity.
    """

    makespan: float
    communication: float
    total: float
    memory: tuple[float, ...]
    feasible: bool


def placement_cost(problem: PlacementProblem, assignment: Sequence[int]) -> PlacementCost:
    """Evaluate ``assignment`` (one device index per item) under ``problem``'s cost model.

    Args:
        problem: The instance.
        assignment: ``assignment[i]`` is the device index of item i.

    Returns:
        The cost breakdown; infeasible placements are evaluated too (``feasible=False``).

    Raises:
        ValueError: if ``assignment`` has the wrong length or an index out of range.
    """
    if len(assignment) != problem.n:
        raise ValueError(f"assignment must have {problem.n} entries (one per item), got {len(assignment)}")
    speeds = problem.effective_speeds
    times = [0.0] * problem.m
    memory = [0.0] * problem.m
    for i, j in enumerate(assignment):
        if isinstance(j, bool) or not isinstance(j, int) or not 0 <= j < problem.m:
            raise ValueError(f"assignment[{i}] must be a device index in [0, {problem.m}), got {j!r}")
        memory[j] += problem.sizes[i]
        c = problem.compute[i]
        if c > 0:
            times[j] += c / speeds[j] if speeds[j] > 0 else math.inf
    makespan = max(times)
    comm = sum(w * problem.distance[assignment[i]][assignment[k]] for i, k, w in problem.traffic)
    total = (problem.alpha * makespan if problem.alpha else 0.0) + (
        problem.beta * comm if problem.beta else 0.0
    )
    feasible = all(fits(memory[j], problem.capacities[j]) for j in range(problem.m))
    return PlacementCost(makespan, comm, total, tuple(memory), feasible)
