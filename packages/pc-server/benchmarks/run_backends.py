"""The gradient server's pushes per second over 1, 2 and 4 clients on each RPC backend (issue 32).

For every point N and backend (``c10d``: a gloo link per pair of members; ``tensorpipe``: TCP only, the
World's default), a local world of N processes (``run_world(..., rpc_backend=...)``) runs the scaling
benchmark's gradient server as ``scaling_legs.py`` builds it (imported, not copied: every rank a client and a
secondary reducer, the primary on rank 0, 4 tensors x 25k floats, ``reduce_batch_size=4``,
``flush_timeout=0.05``); every client pushes ``pushes`` times per repetition, barrier to barrier, until the
primary has applied every push. Pushes per second = N x pushes / that time.

A process holds one World, so every (backend, N) runs in a world of its own; the backends alternate within a
round and the order of everything is reversed every other round, so a load drift of the shared machine hits
both alike. The samples of all rounds are pooled and compared by medians. Target (issue 32): server scaling
no worse than on TensorPipe, met when c10d's pushes/s are at least TensorPipe's at every client count, or
else when c10d's scaling from 1 to 4 clients (pushes/s at 4 / at 1) is at least TensorPipe's. Times are only
reported, never asserted. Usage: ``python run_backends.py [--quick] [--out results.json]``.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from benchlib import Report, bench_args
from scaling_legs import WAIT, worker

from pc_distributed import run_world

BACKENDS = {"c10d": "c10d", "tensorpipe": "TensorPipe TCP only"}
POINTS = (1, 2, 4)


def _pushes_per_s(backend: str, n: int, pushes: int, reps: int) -> list[float]:
    """One world of ``n`` processes on ``backend``: pushes per second (all clients) of each repetition."""
    results: list[dict[str, Any]] = run_world(
        worker, n, args=(pushes, reps), timeout=300, dist_timeout=WAIT, rpc_timeout=WAIT, rpc_backend=backend
    )
    return [n * pushes / run["applied_s"] for run in results[0]["runs"]]


def main() -> None:
    args = bench_args("pc-server")
    report = Report("pc-server")
    started = time.perf_counter()
    rounds, pushes, reps = (1, 10, 1) if args.quick else (2, 30, 3)
    order = [(backend, n) for n in POINTS for backend in BACKENDS]
    samples: dict[tuple[str, int], list[float]] = {key: [] for key in order}
    for r in range(rounds):
        for backend, n in order if r % 2 == 0 else order[::-1]:
            samples[(backend, n)] += _pushes_per_s(backend, n, pushes, reps)
    rate = {key: statistics.median(s) for key, s in samples.items()}

    for n in POINTS:
        case = f"issue 32: grad server pushes/s, {n} client{'s' if n > 1 else ''}"
        for backend, label in BACKENDS.items():
            report.row(
                case,
                f"PushPullGradServer, {label}",
                rate[(backend, n)],
                "1/s",
                baseline=backend == "tensorpipe",
                higher_is_better=True,
            )
    per_count = {n: rate[("c10d", n)] / rate[("tensorpipe", n)] for n in POINTS}
    scaling = {b: rate[(b, POINTS[-1])] / rate[(b, POINTS[0])] for b in BACKENDS}
    scaling_ratio = scaling["c10d"] / scaling["tensorpipe"]
    every_count = min(per_count.values())
    # met by either criterion (the brief's "or"); the measured value is the criterion that decided
    if every_count >= 1.0:
        measured, used = every_count, "c10d pushes/s / TensorPipe's, the lowest over 1, 2, 4 clients"
    else:
        measured, used = scaling_ratio, "c10d's scaling 4/1 clients / TensorPipe's"
    report.target(
        "(issue 32) grad server scaling on c10d vs TensorPipe TCP-only",
        measured,
        ">=",
        1.0,
        note="" if measured >= 1.0 else f"{used}; c10d/TensorPipe per client count "
        + ", ".join(f"{n}: {v:.2f}x" for n, v in per_count.items()),
    )
    report.note(
        f"issue 32 grad server: measured value = {used}. c10d / TensorPipe pushes/s: "
        + ", ".join(f"{n} client(s) {v:.3f}x" for n, v in per_count.items())
        + f"; scaling 1 -> 4 clients: c10d {scaling['c10d']:.2f}x, TensorPipe {scaling['tensorpipe']:.2f}x "
        f"(c10d / TensorPipe {scaling_ratio:.3f})"
    )
    report.note(
        f"issue 32 grad server: {rounds} round(s) x {reps} repetition(s) of {pushes} pushes per client per "
        f"(backend, clients), medians of the pooled samples; total run time "
        f"{time.perf_counter() - started:.1f} s, quick={args.quick}"
    )
    report.finish(args)


if __name__ == "__main__":
    main()
