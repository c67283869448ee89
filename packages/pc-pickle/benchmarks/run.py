"""pc-pickle benchmark: dumps+loads against pickle protocol 5, dill, cloudpickle and torch's share handle.

Run from the repository root: ``python packages/pc-pickle/benchmarks/run.py [--quick] [--out PATH]``.
All variants run interleaved in one process with one torch thread; ratios are what counts.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
from multiprocessing.reduction import ForkingPickler

import cloudpickle
import dill
import torch
from benchlib import Report, bench_args, median_time

import pc_pickle


class Point:
    """A small plain object (goes through reducer_override, unlike dicts)."""

    def __init__(self, i: int) -> None:
        self.x = i
        self.y = float(i) / 3
        self.label = f"p{i}"


def _round_trip(dumps: Callable[[Any], bytes], loads: Callable[[bytes], Any]) -> Callable[[Any], Any]:
    return lambda obj: loads(dumps(obj))


PEERS: dict[str, tuple[Callable[[Any], bytes], Callable[[bytes], Any]]] = {
    "pc_pickle": (pc_pickle.dumps, pc_pickle.loads),
    "pickle5": (lambda o: pickle.dumps(o, protocol=5), pickle.loads),
    "dill": (lambda o: dill.dumps(o, protocol=5), dill.loads),
    "cloudpickle": (lambda o: cloudpickle.dumps(o, protocol=5), pickle.loads),
}


def interleaved_min(fns: dict[str, Callable[[], Any]], repeat: int) -> dict[str, float]:
    """Min wall time per variant, the variants interleaved round by round (load drifts hit all alike)."""
    for fn in fns.values():  # warm-up
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: min(values) for name, values in samples.items()}


def bench_case(report: Report, case: str, obj: Any, repeat: int, peers: list[str]) -> dict[str, float]:
    fns = {name: (lambda d=PEERS[name][0], ld=PEERS[name][1]: ld(d(obj))) for name in peers}
    times = interleaved_min(fns, repeat)
    for name in peers:
        report.row(case, name, times[name], baseline=(name == "pickle5"))
    return times


def main() -> None:
    args = bench_args("pc-pickle")
    torch.set_num_threads(1)
    quick = args.quick
    repeat = 5 if quick else 7
    report = Report("pc-pickle")
    report.note(
        f"loadavg at start {os.getloadavg()}; {'quick' if quick else 'full'} run; 1 torch thread; "
        "(a)-(d): min of interleaved rounds of dumps+loads; (e): median"
    )

    # (a) a dict holding a 100 MB float32 tensor
    n_big = (10 if quick else 100) * 1_000_000 // 4
    big = {"weight": torch.randn(n_big), "step": 3}
    t = bench_case(report, f"(a) {n_big * 4 // 1_000_000} MB tensor", big, repeat, list(PEERS))
    report.target("(a) big tensor dumps+loads vs pickle5", t["pc_pickle"] / t["pickle5"], "<=", 0.5)

    # (b) 10,000 small Python objects
    small = [Point(i) if i % 2 else {"id": i, "name": f"n{i}", "v": (i, 0.5)} for i in range(10_000)]
    t = bench_case(report, "(b) 10k small objects", small, repeat, list(PEERS))
    report.target("(b) small objects vs pickle5", t["pc_pickle"] / t["pickle5"], "<=", 1.5)

    # (c) 10,000 tiny tensors
    tiny = [torch.randn(4) for _ in range(2_000 if quick else 10_000)]
    t = bench_case(report, f"(c) {len(tiny)} tiny tensors", tiny, repeat, list(PEERS))
    report.target("(c) tiny tensors vs pickle5", t["pc_pickle"] / t["pickle5"], "<=", 0.3)
    ours_size, peer_size = len(pc_pickle.dumps(tiny)), len(pickle.dumps(tiny, protocol=5))
    size_ratio = ours_size / peer_size
    report.row(f"(c) {len(tiny)} tiny tensors: payload", "pc_pickle", ours_size, unit="B")
    report.row(f"(c) {len(tiny)} tiny tensors: payload", "pickle5", peer_size, unit="B", baseline=True)
    report.target("(c) tiny tensors payload vs pickle5", size_ratio, "<=", 0.5)

    # (d) a 25M-parameter state_dict
    width = 700 if quick else 2236
    layers = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(5)])
    state = layers.state_dict()
    params = sum(v.numel() for v in state.values())
    bench_case(report, f"(d) state_dict {params / 1e6:.1f}M params", state, repeat, list(PEERS))

    # (e) a lambda and a closure
    offset = torch.ones(3)

    def closure(x: torch.Tensor) -> torch.Tensor:
        return x + offset

    fns = [lambda x: x * 2, closure]
    peers = ["pc_pickle", "dill", "cloudpickle"]
    t = {
        name: median_time(lambda n=name: PEERS[n][1](PEERS[n][0](fns)), repeat=repeat, number=20)
        for name in peers
    }
    for name in peers:
        report.row("(e) lambda + closure", name, t[name])
    report.row("(e) lambda + closure", "dill (baseline)", t["dill"], baseline=True)
    report.target("(e) lambda + closure vs dill", t["pc_pickle"] / t["dill"], "<=", 2.0)

    # share handle of a pre-shared 100 MB tensor: dumps time and payload size (each payload is loaded
    # afterwards, untimed, so no dup'd fd stays behind)
    shared = torch.zeros(n_big).share_memory_()
    samples, fp_samples = [], []
    size = 0
    for _ in range(max(repeat, 5)):
        start = time.perf_counter()
        data = pc_pickle.dumps(shared, copy_tensor=False)
        samples.append(time.perf_counter() - start)
        size = len(data)
        pc_pickle.loads(data)
        start = time.perf_counter()
        fp = bytes(ForkingPickler.dumps(shared))
        fp_samples.append(time.perf_counter() - start)
        ForkingPickler.loads(fp)
    samples.sort()
    fp_samples.sort()
    ours_ms = samples[len(samples) // 2] * 1e3
    report.row("share handle dumps (pre-shared)", "pc_pickle", ours_ms / 1e3)
    report.row(
        "share handle dumps (pre-shared)",
        "torch ForkingPickler",
        fp_samples[len(fp_samples) // 2],
        baseline=True,
    )
    report.row("share handle payload", "pc_pickle", size, unit="B")
    report.row("share handle payload", "torch ForkingPickler", len(fp), unit="B", baseline=True)
    report.target("share handle dumps time", ours_ms, "<=", 1.0, unit="ms")
    report.target("share handle payload size", size, "<=", 1024, unit="B")
    report.note("CUDA handle and copy paths are not measured: this machine has no GPU")
    report.finish(args)


if __name__ == "__main__":
    main()
