"""pc-pool benchmarks: our pools and their peers side by side in one run.

Cases (2 workers each):

* 10,000 trivial tasks at chunksize 1 and with automatic chunking: pc_pool.Pool (fork), multiprocessing.Pool
  (fork; spawn in full runs), concurrent.futures.ProcessPoolExecutor (fork) and loky.
* 200 sequential ``apply`` calls: pc_pool vs multiprocessing.Pool (fork).
* Pool start-up (until the first result) with torch imported: fork for both; spawn in full runs.
* A tensor (100 MB; 10 MB with --quick) to a worker and back: pc_pool copy, pc_pool share (freshly shared and
  pre-shared) against a stdlib pickle copy through multiprocessing.Pool.
* Fault latency: a SIGKILLed worker reported, and ``terminate()`` with 20 sleeping tasks.
* A task function pickled by value (defined in ``__main__``, as this script's are) against its twin pickled by
  name (``pool_bench_tasks``), 100 sequential ``apply`` calls each: an in-place add on a shared 4 MB tensor
  (share mode) and a closure (copy mode). The pool reuses the by-value payload while nothing in it changed.

Run: ``python packages/pc-pool/benchmarks/run.py [--quick] [--out results.json]``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import pathlib
import pickle
import signal
import statistics
import sys
import time
import warnings
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
import pool_bench_tasks
import torch
from benchlib import Report, bench_args, median_time

import pc_pool

warnings.filterwarnings("ignore", message=".*multi-threaded.*fork.*", category=DeprecationWarning)
FORK = multiprocessing.get_context("fork")
SPAWN = multiprocessing.get_context("spawn")


def ident(x: object) -> object:
    return x


def touch(t: torch.Tensor) -> torch.Tensor:
    return t


def pickle_roundtrip(blob: bytes) -> bytes:
    return pickle.dumps(pickle.loads(blob), protocol=5)


def add_one(t: torch.Tensor) -> None:
    t.add_(1)


def make_scaler(k: int) -> Any:
    def scale(x: int) -> int:
        return k * x

    return scale


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def nap() -> None:
    time.sleep(30)


def _interleaved(fns: dict[str, object], rounds: int) -> dict[str, list[float]]:
    """Wall times of ``rounds`` interleaved rounds (one call of each variant per round, after a warm-up)."""
    for fn in fns.values():
        fn()  # type: ignore[operator]
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            begin = time.perf_counter()
            fn()  # type: ignore[operator]
            samples[name].append(time.perf_counter() - begin)
    return samples


def _paired_ratio(num: list[float], den: list[float]) -> float:
    """Median over rounds of ``num[i] / den[i]``: each round's pair ran back to back under the same load."""
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


def throughput(report: Report, n: int, repeat: int, full: bool) -> None:
    items = list(range(n))
    results: dict[str, tuple[float, float]] = {}

    def measure(name: str, c1: object, auto: object) -> None:
        t1 = median_time(c1, repeat=repeat)  # type: ignore[arg-type]
        ta = median_time(auto, repeat=repeat)  # type: ignore[arg-type]
        results[name] = (t1, ta)

    # The target: pc_pool and mp.Pool (fork) at chunksize 1, interleaved round by round on one
    # machine, ratio of the paired rounds (the machine is shared: a load drift hits both alike).
    with pc_pool.Pool(2, share_method="cpu") as ours, FORK.Pool(2) as mp:
        c1 = _interleaved(
            {
                "pc_pool fork": lambda: ours.map(ident, items, chunksize=1),
                "mp.Pool fork": lambda: mp.map(ident, items, chunksize=1),
            },
            max(5, 2 * repeat + 1),
        )
        c1_ratio = _paired_ratio(c1["mp.Pool fork"], c1["pc_pool fork"])
        results["pc_pool fork"] = (
            statistics.median(c1["pc_pool fork"]),
            median_time(lambda: ours.map(ident, items), repeat=repeat),
        )
        results["mp.Pool fork"] = (
            statistics.median(c1["mp.Pool fork"]),
            median_time(lambda: mp.map(ident, items), repeat=repeat),
        )
    if full:
        with SPAWN.Pool(2) as mp:
            measure("mp.Pool spawn", lambda: mp.map(ident, items, chunksize=1), lambda: mp.map(ident, items))
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=FORK) as ppe:
        auto = max(1, n // 8)
        measure(
            "ProcessPoolExecutor fork",
            lambda: list(ppe.map(ident, items, chunksize=1)),
            lambda: list(ppe.map(ident, items, chunksize=auto)),
        )
    try:
        import loky

        executor = loky.ProcessPoolExecutor(2)
        try:
            auto = max(1, n // 8)
            measure(
                "loky",
                lambda: list(executor.map(ident, items, chunksize=1)),
                lambda: list(executor.map(ident, items, chunksize=auto)),
            )
        finally:
            executor.shutdown(wait=True)
    except ImportError:
        report.note("loky not installed: skipped")
    for name, (t1, _) in results.items():
        report.row(f"{n} tasks, chunksize 1", name, t1, baseline=name == "mp.Pool fork")
    for name, (_, ta) in results.items():
        report.row(f"{n} tasks, auto chunks", name, ta, baseline=name == "mp.Pool fork")
    report.target(
        "chunksize-1 throughput vs mp.Pool(fork)",
        c1_ratio,
        ">=",
        1.0,
        note="mp.Pool time / pc_pool time, median of interleaved paired rounds",
    )
    rate = n / results["pc_pool fork"][1]
    report.row(f"{n} tasks, auto chunks, rate", "pc_pool fork", rate, unit="/s", higher_is_better=True)
    if n >= 10_000:
        report.target("auto-chunked throughput (tasks/s)", rate, ">=", 1e6, unit="/s")
    else:
        report.note(f"auto-chunked rate measured on {n} tasks only (--quick): {rate:.3g}/s, target needs 10k")


def sequential_applies(report: Report, repeat: int) -> None:
    with pc_pool.Pool(2, share_method="cpu") as ours, FORK.Pool(2) as mp:
        times = _interleaved(
            {
                "pc_pool fork": lambda: [ours.apply(ident, (i,)) for i in range(200)],
                "mp.Pool fork": lambda: [mp.apply(ident, (i,)) for i in range(200)],
            },
            max(11, 10 * repeat + 1),
        )
    report.row("200 sequential apply", "pc_pool fork", statistics.median(times["pc_pool fork"]))
    report.row(
        "200 sequential apply", "mp.Pool fork", statistics.median(times["mp.Pool fork"]), baseline=True
    )
    report.target(
        "200 sequential applies vs mp.Pool",
        _paired_ratio(times["pc_pool fork"], times["mp.Pool fork"]),
        "<=",
        1.0,
        note="pc_pool time / mp.Pool time, median of interleaved paired rounds",
    )


def startup(report: Report, full: bool) -> None:
    def start(factory: object) -> float:
        begin = time.perf_counter()
        pool = factory()  # type: ignore[operator]
        try:
            pool.apply(ident, (1,))
            return time.perf_counter() - begin
        finally:
            pool.terminate()
            pool.join()

    t_ours = min(start(lambda: pc_pool.Pool(2, share_method="cpu")) for _ in range(3))
    t_mp = min(start(lambda: FORK.Pool(2)) for _ in range(3))
    report.row("start-up (fork, torch imported)", "pc_pool fork", t_ours)
    report.row("start-up (fork, torch imported)", "mp.Pool fork", t_mp, baseline=True)
    report.target("fork start-up (s)", t_ours, "<=", 0.1, unit="s")
    if full:
        report.row("start-up (spawn, torch imported)", "pc_pool spawn", start(lambda: pc_pool.Pool(2)))
        report.row(
            "start-up (spawn, torch imported)", "mp.Pool spawn", start(lambda: SPAWN.Pool(2)), baseline=True
        )


def tensor_roundtrip(report: Report, mb: int, repeat: int) -> None:
    case = f"{mb} MB tensor round trip"
    t = torch.rand(mb * 1024 * 1024 // 4)
    with FORK.Pool(1) as mp:

        def via_pickle() -> None:
            pickle.loads(mp.apply(pickle_roundtrip, (pickle.dumps(t, protocol=5),)))

        t_pickle = median_time(via_pickle, repeat=repeat)
    with pc_pool.Pool(1, share_method="cpu") as ours:
        t_copy = median_time(lambda: ours.apply(touch, (t,)), repeat=repeat)
    with pc_pool.Pool(1, is_copy_tensor=False, share_method="cpu") as ours:
        t_fresh = median_time(lambda: ours.apply(touch, (t.clone(),)), repeat=repeat)
        t_clone = median_time(lambda: t.clone(), repeat=repeat)
        shared = t.clone().share_memory_()
        t_pre = median_time(lambda: ours.apply(touch, (shared,)), repeat=repeat)
    report.row(case, "pickle5 copy via mp.Pool", t_pickle, baseline=True)
    report.row(case, "pc_pool copy", t_copy)
    report.row(case, "pc_pool share (fresh, incl. clone)", t_fresh)
    report.row(case, "clone() alone (memcpy)", t_clone)
    report.row(case, "pc_pool share (pre-shared)", t_pre)
    report.target("shared round trip vs pickle copy", t_pre / t_pickle, "<=", 0.05)
    report.target("copy round trip vs pickle5 copy", t_copy / t_pickle, "<=", 0.7)


def fault_latency(report: Report) -> None:
    with pc_pool.Pool(2, share_method="cpu") as pool:
        pool.apply(ident, (1,))
        begin = time.perf_counter()
        with contextlib.suppress(pc_pool.WorkerDiedError):
            pool.apply_async(die).get(30)
        died = time.perf_counter() - begin
        pending = [pool.apply_async(nap) for _ in range(20)]
        begin = time.perf_counter()
        pool.terminate()
        for r in pending:
            with contextlib.suppress(pc_pool.PoolTerminatedError):
                r.get(30)
        terminated = time.perf_counter() - begin
    report.row("worker SIGKILL reported (incl. task)", "pc_pool fork", died)
    report.row("terminate() with 20 sleeping tasks", "pc_pool fork", terminated)
    report.target("death reported (s)", died, "<=", 0.5, unit="s")
    report.target("terminate() (s)", terminated, "<=", 2.0, unit="s")


def function_payloads(report: Report, repeat: int) -> None:
    """By-value task functions (``__main__``, closures) against by-name twins: 100 sequential applies each."""
    rounds = max(11, 10 * repeat + 1)
    t = torch.zeros(1 << 20).share_memory_()  # 4 MB
    with pc_pool.Pool(1, is_copy_tensor=False, share_method="cpu") as pool:
        shared = _interleaved(
            {
                "by value (__main__)": lambda: [pool.apply(add_one, (t,)) for _ in range(100)],
                "by name": lambda: [pool.apply(pool_bench_tasks.add_one, (t,)) for _ in range(100)],
            },
            rounds,
        )
    scale = make_scaler(3)
    with pc_pool.Pool(1, share_method="cpu") as pool:
        copied = _interleaved(
            {
                "by value (closure)": lambda: [pool.apply(scale, (i,)) for i in range(100)],
                "by name": lambda: [pool.apply(pool_bench_tasks.triple, (i,)) for i in range(100)],
            },
            rounds,
        )
    for case, times, by_value in (
        ("100 applies, share, in-place add on 4 MB", shared, "by value (__main__)"),
        ("100 applies, copy, closure", copied, "by value (closure)"),
    ):
        report.row(case, f"pc_pool task {by_value}", statistics.median(times[by_value]))
        report.row(case, "pc_pool task by name", statistics.median(times["by name"]), baseline=True)
        report.target(
            f"{case}: task function by value vs by name",
            _paired_ratio(times[by_value], times["by name"]),
            "<=",
            1.15,
            note="by-value time / by-name time, median of interleaved paired rounds",
        )


def main() -> None:
    args = bench_args("pc-pool")
    report = Report("pc-pool")
    torch.set_num_threads(1)
    logging.getLogger("pc_pool").setLevel(logging.ERROR)  # the fault case logs the worker death on purpose
    full = not args.quick
    repeat = 3 if full else 1
    throughput(report, 10_000 if full else 2_000, repeat, full)
    sequential_applies(report, repeat)
    startup(report, full)
    tensor_roundtrip(report, 100 if full else 10, repeat)
    fault_latency(report)
    function_payloads(report, repeat)
    load = os.getloadavg()
    report.note(
        f"load average during the run: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {os.cpu_count()} CPUs"
    )
    if not full:
        report.note("--quick: smaller sizes, no spawn peers; run without --quick for the targets")
    report.finish(args)


if __name__ == "__main__":
    main()
