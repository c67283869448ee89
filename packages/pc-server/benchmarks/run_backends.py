"""The gradient server's pushes per second over 1, 2 and 4 clients on each RPC backend (issue 32).

Backends: ``c10d`` (a gloo link per pair of members, pc-pickle) and ``tensorpipe`` with TCP only (the World's
default). Per backend, a local world of 4 processes (``run_world(..., rpc_backend=...)``) builds the scaling
benchmark's gradient server once for every point N (the first N ranks: ``benchmarks/scaling``'s
``grad_server``, ``Blob`` and ``GRAD``, imported, and its ``Point`` without the DataParallel half: every
member a client and a secondary reducer, the primary on rank 0, 4 tensors x 25k floats,
``reduce_batch_size=4``, ``flush_timeout=0.05``). Then, ``reps`` times, for every point in turn (the order
reversed every other repetition), every client of the point pushes ``pushes`` times, barrier to barrier,
until the primary has applied (or dropped) every push; pushes per second = N x pushes / that time. The other
ranks wait on a barrier meanwhile, as in the scaling benchmark.

A process holds one World, so each backend runs in worlds of its own, alternating, for several rounds (the
order reversed every other round); the samples of all rounds are pooled and compared by medians. A world that
fails is recorded (its error in a note) and its backend skipped from then on, so the run still ends. A third
world per round runs TensorPipe again, measured and compared the same way as c10d: this A/A control says how
far apart two runs of one backend land on the machine, the noise floor the c10d figures are read against.

Target (issue 32): server scaling no worse than on TensorPipe. Met when c10d's pushes/s are at least
TensorPipe's at every client count (the measured value is then the lowest c10d/TensorPipe ratio), or else
when c10d's scaling from 1 to 4 clients (pushes/s at 4 / at 1) is at least TensorPipe's (the measured value
is then that quotient); a note says which. Times are only reported, never asserted. Usage:
``python run_backends.py [--quick] [--out results.json]``.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "scaling"))
from benchlib import Report, bench_args
from scaling_worker import GRAD, Blob, Point, grad_server

import pc_distributed
from pc_distributed import run_world

# Seconds of a World's start, a call, a barrier, the primary's drain, and the c10d links' timeout; a world
# whose backend fails costs about this much before it ends (full run, quick run).
WAIT, QUICK_WAIT = 90.0, 40.0
# The worlds of a round: a name, its backend, the label of its rows. The control is TensorPipe measured again.
WORLDS = (
    ("c10d", "c10d", "c10d"),
    ("tensorpipe", "tensorpipe", "TensorPipe TCP only"),
    ("control", "tensorpipe", "TensorPipe TCP only, A/A control (a second world)"),
)


class GradPoint(Point):
    """The scaling benchmark's point N without its DataParallel: the gradient server of the first N ranks.

    Its ``push``, ``drained``, ``wait_drained`` and ``stop`` are :class:`scaling_worker.Point`'s.
    """

    def __init__(self, world: Any, n: int, rank: int, wait: float) -> None:
        self.n, self.rank, self.wait = n, rank, wait
        if rank >= n:
            return
        names = [world.name_of(r) for r in range(n)]
        self.group = world.create_rpc_group(f"point{n}", names, timeout=wait)
        self.impl = grad_server(f"gs{n}", self.group, names, rank)
        self.group.barrier(wait)
        self.gs = self.group.get_paired(f"gs{n}").to_here()
        self.model = Blob(*GRAD)
        self.grads = [torch.randn(GRAD[1]) for _ in range(GRAD[0])]
        self.pushed = 0
        for _ in range(3):  # warm-up, drained before the first measurement
            self.push()
        if rank == 0:
            self.wait_drained()
        self.group.barrier(wait)

    def pushes_per_s(self, pushes: int) -> float:
        """Every client pushes ``pushes`` times; all pushes per second until the primary applied them."""
        self.group.barrier(self.wait)
        start = time.monotonic()
        for _ in range(pushes):
            self.push()
        self.group.barrier(self.wait)
        if self.rank == 0:
            self.wait_drained()
        return self.n * pushes / (time.monotonic() - start)


def _rank(rank: int, points: list[int], pushes: int, reps: int, wait: float) -> dict[int, list[float]]:
    """One rank of a backend's world: every point's pushes per second, ``reps`` times (rank 0's are kept)."""
    torch.set_num_threads(1)
    world = pc_distributed.get_world()
    assert world is not None
    everyone = world.create_rpc_group("everyone", world.get_members(), timeout=wait)
    built = [GradPoint(world, n, rank, wait) for n in points]
    samples: dict[int, list[float]] = {n: [] for n in points}
    for rep in range(reps):
        for point in built if rep % 2 == 0 else built[::-1]:
            everyone.barrier(wait)
            if rank < point.n:
                samples[point.n].append(point.pushes_per_s(pushes))
    everyone.barrier(wait)
    for point in built:
        if rank < point.n:
            point.stop()
    everyone.barrier(wait)
    return samples


def main() -> None:
    args = bench_args("pc-server")
    report = Report("pc-server")
    started = time.perf_counter()
    points, rounds, pushes, reps = ([1, 2], 1, 10, 2) if args.quick else ([1, 2, 4], 2, 25, 4)
    wait = QUICK_WAIT if args.quick else WAIT
    samples: dict[tuple[str, int], list[float]] = {(w, n): [] for w, _, _ in WORLDS for n in points}
    failed: dict[str, str] = {}
    order = [(w, backend) for w, backend, _ in WORLDS]
    for r in range(rounds):
        for world, backend in order if r % 2 == 0 else order[::-1]:
            if world in failed:
                continue
            try:
                got = run_world(
                    _rank,
                    points[-1],
                    args=(points, pushes, reps, wait),
                    timeout=2 * wait + 120,
                    init_dist=False,
                    dist_timeout=wait,
                    rpc_timeout=wait,
                    rpc_backend=backend,
                )[0]
            except Exception as exc:
                failed[world] = f"round {r + 1}: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
                continue
            for n in points:
                samples[(world, n)] += got[n]
    rate = {key: statistics.median(s) for key, s in samples.items() if s}

    for n in points:
        case = f"issue 32: grad server pushes/s, {n} client{'s' if n > 1 else ''}"
        for world, _, label in WORLDS:
            if (world, n) in rate:
                report.row(
                    case,
                    f"PushPullGradServer, {label}",
                    rate[(world, n)],
                    "1/s",
                    baseline=world == "tensorpipe",
                    higher_is_better=True,
                )
    name = "(issue 32) grad server scaling on c10d vs TensorPipe TCP-only"
    for world, why in failed.items():
        report.note(
            f"issue 32 grad server: the {world} world failed ({why}); {world} skipped since (the "
            "ranks' stderr has the transport's log of what failed first)"
        )
    if {"c10d", "tensorpipe"} & set(failed):
        report.target(name, 0.0, ">=", 1.0, note=f"not measured: a world failed ({', '.join(failed)})")
    else:
        per_count = {n: rate[("c10d", n)] / rate[("tensorpipe", n)] for n in points}
        scaling = {w: rate[(w, points[-1])] / rate[(w, points[0])] for w, _, _ in WORLDS if w not in failed}
        scaling_ratio = scaling["c10d"] / scaling["tensorpipe"]
        control = ""
        if "control" in scaling:
            control_counts = ", ".join(
                f"{n}: {rate[('control', n)] / rate[('tensorpipe', n)]:.2f}x" for n in points
            )
            control = (
                f"A/A control, TensorPipe's second world / its first: per client count {control_counts}, "
                f"scaling quotient {scaling['control'] / scaling['tensorpipe']:.3f}"
            )
        lowest = min(per_count.values())
        if lowest >= 1.0:
            measured, used = lowest, "the lowest c10d / TensorPipe pushes/s over the client counts"
        else:
            measured, used = scaling_ratio, f"c10d's scaling 1 -> {points[-1]} clients / TensorPipe's"
        counts = ", ".join(f"{n}: {v:.2f}x" for n, v in per_count.items())
        why = "" if measured >= 1.0 else f"{used}; c10d / TensorPipe pushes/s per client count {counts}"
        report.target(name, measured, ">=", 1.0, note="; ".join(part for part in (why, control) if part))
        report.note(
            f"issue 32 grad server: the target's value is {used}. c10d / TensorPipe pushes/s per client "
            f"count: {counts}; scaling 1 -> {points[-1]} clients: c10d {scaling['c10d']:.2f}x, TensorPipe "
            f"{scaling['tensorpipe']:.2f}x (quotient {scaling_ratio:.3f})"
            + (f"; {control}" if control else "")
        )
    report.note(
        f"issue 32 grad server: {rounds} round(s) of one {points[-1]}-process world per backend and one "
        f"more of TensorPipe (the A/A control), {reps} "
        f"repetitions of {pushes} pushes per client per point and world; medians of the pooled samples; "
        f"total run time {time.perf_counter() - started:.1f} s, quick={args.quick}"
    )
    report.finish(args)


if __name__ == "__main__":
    main()
