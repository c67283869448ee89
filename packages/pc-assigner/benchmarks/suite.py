"""The seeded benchmark suite of placement problems (shared by run.py, make_optima.py and the tests).

Families of traffic: ``chain`` (i -> i+1), ``skip`` (chain plus i -> i+2 and i -> i+4), ``fanio``
(actor-critic style: item 0 feeds every item, every item feeds the last) and ``independent`` (no traffic).

Devices: ``homo`` is m GPUs of speed 1 at distance 0.1 from each other; ``mixed`` is m-1 GPUs of speeds 1.0
and 0.7 (alternating) plus a CPU of speed 0.1 at distance 1.0 from every GPU.

Memory tightness tau in {0.6, 0.9, 1.2, 1.5}: on ``mixed`` the GPUs together hold tau x the total size and
the CPU holds everything; on ``homo`` (where tau < 1 would be infeasible) each device holds (1 + tau / 3) x
the total / m. Capacities are raised to the largest item where needed so that a placement exists, except in
the one ``infeasible`` instance. Sizes are whole bytes (lognormal around 100 MiB), compute and traffic
lognormal; the ground-truth cost uses alpha = beta = 1."""

from __future__ import annotations

import random

from pc_assigner import PlacementProblem

__all__ = ["FAMILIES", "TIGHTNESS", "Instance", "large_suite", "make_instance", "suite"]

FAMILIES = ("chain", "skip", "fanio", "independent")
TIGHTNESS = (0.6, 0.9, 1.2, 1.5)
MIB = 2**20

Instance = tuple[str, dict[str, object], PlacementProblem]


def _traffic(family: str, n: int, rng: random.Random) -> dict[tuple[int, int], float]:
    t: dict[tuple[int, int], float] = {}
    if family in ("chain", "skip"):
        for i in range(n - 1):
            t[(i, i + 1)] = rng.lognormvariate(0, 1)
    if family == "skip":
        for step in (2, 4):
            for i in range(n - step):
                if rng.random() < 0.5:
                    t[(i, i + step)] = rng.lognormvariate(-1, 1)
    if family == "fanio":
        for i in range(1, n - 1):
            t[(0, i)] = rng.lognormvariate(-0.5, 1)
            t[(i, n - 1)] = rng.lognormvariate(-0.5, 1)
    return t


def make_instance(n: int, m: int, family: str, tight: float, kind: str, seed: int) -> Instance:
    """One instance, fully determined by its parameters."""
    rng = random.Random(f"{n}-{m}-{family}-{tight}-{kind}-{seed}")
    sizes = [float(int(rng.lognormvariate(0, 1) * 100 * MIB)) for _ in range(n)]
    compute = [rng.lognormvariate(0, 1) for _ in range(n)]
    total = sum(sizes)
    if kind == "homo" or m == 1:
        speeds = [1.0] * m
        caps = [max((1 + tight / 3) * total / m, max(sizes) * 1.05)] * m
        dist = [[0.0 if a == b else 0.1 for b in range(m)] for a in range(m)]
    else:
        speeds = [1.0 if j % 2 == 0 else 0.7 for j in range(m - 1)] + [0.1]
        gpu_cap = max(tight * total / (m - 1), max(sizes) * 1.05)
        caps = [gpu_cap] * (m - 1) + [2 * total]
        dist = [[0.0 if a == b else (1.0 if m - 1 in (a, b) else 0.1) for b in range(m)] for a in range(m)]
    caps = [float(int(c)) for c in caps]
    if kind == "infeasible":
        caps = [total / m * 0.9] * m
    params: dict[str, object] = {
        "n": n,
        "m": m,
        "family": family,
        "tightness": tight,
        "kind": kind,
        "seed": seed,
    }
    name = f"n{n:02d}-m{m}-{family}-t{tight}-{kind}-s{seed}"
    problem = PlacementProblem(
        sizes=tuple(sizes),
        compute=tuple(compute),
        capacities=tuple(caps),
        speeds=tuple(speeds),
        distance=tuple(tuple(r) for r in dist),
        traffic=tuple((i, k, w) for (i, k), w in sorted(_traffic(family, n, rng).items())),
    )
    return name, params, problem


def suite(quick: bool = False) -> list[Instance]:
    """The benchmark instances (``quick``: those with n <= 12)."""
    out: list[Instance] = []
    idx = 0
    for n in (4, 8, 12, 16, 24, 32):
        if quick and n > 12:
            continue
        for m in (2, 3, 4):
            for family in FAMILIES:
                tight = TIGHTNESS[(idx + idx // 4) % 4]
                kind = "mixed" if (idx // 4) % 2 else "homo"
                out.append(make_instance(n, m, family, tight, kind, seed=0))
                idx += 1
    for family in ("chain", "fanio"):
        out.append(make_instance(8, 1, family, 1.5, "homo", seed=0))
    out.append(make_instance(6, 2, "chain", 1.0, "infeasible", seed=0))
    return out


def large_suite(quick: bool = False) -> list[Instance]:
    """n = 200 modules on 4 devices, every family on both kinds at tightness 1.2 (``quick``: two of them)."""
    kinds = ("homo", "mixed")
    families = ("chain", "fanio") if quick else FAMILIES
    return [make_instance(200, 4, family, 1.2, kind, seed=0) for family in families for kind in kinds][
        : 2 if quick else None
    ]
