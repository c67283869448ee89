"""pc-replicate benchmarks: CPU thread replicas vs the direct call, Parallel vs a serial loop.

Run from the repository root::

    .venv/bin/python packages/pc-replicate/benchmarks/run.py [--quick] [--out PATH]

Everything runs with ``torch.set_num_threads(1)`` (advised for thread replicas on few cores; the issue's
target is stated for it). Competing implementations are timed round-robin, one call of each per round, so that
load from other processes hits them alike; the medians are reported. Peers, measured in the same run:

- the direct call of the module on the full batch (what ``torch.nn.DataParallel`` does on a CPU-only machine);
- a serial loop over the items, and a minimal port of gluon-nlp's two-queue ``Parallel`` (no error handling),
  for ``pc_replicate.Parallel``.
"""

from __future__ import annotations

import contextlib
import pathlib
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
from benchlib import Report, bench_args, median_time

from pc_replicate import Parallel, Parallelizable, ReplicationCallbackDataParallel, _apply, _cpu
from pc_replicate._pool import ReplicaThreads


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def interleaved(
    fns: dict[str, Callable[[], object]], *, repeat: int, warmup: int = 2, number: int = 1
) -> dict[str, float]:
    """Median seconds per call of each function, timed round-robin (``number`` calls per round)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(number):
                fn()
            samples[name].append((time.perf_counter() - start) / number)
            cpu[name].append((time.process_time() - start_cpu) / number)
    LAST_CPU.clear()
    LAST_CPU.update({name: statistics.median(values) for name, values in cpu.items()})
    return {name: statistics.median(values) for name, values in samples.items()}


#: Median process CPU seconds per call from the last ``interleaved`` run (less sensitive to other processes'
#: load than wall time; includes every thread of this process).
LAST_CPU: dict[str, float] = {}


def step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()


class MLPStep(Parallelizable):
    def __init__(self, net: nn.Module) -> None:
        self.net = net

    def forward_backward(self, x: torch.Tensor) -> torch.Tensor:
        loss = self.net(x).sum()
        loss.backward()
        return loss.detach()


class NoOp(Parallelizable):
    def forward_backward(self, x: Any) -> Any:
        return x


class GluonParallel:
    """gluon-nlp's Parallel (v0.x), ported as-is: two queues, no error records, no timeouts."""

    _STOP = object()

    def __init__(self, num_workers: int, parallelizable: Any) -> None:
        self._in: queue.Queue[Any] = queue.Queue()
        self._out: queue.Queue[Any] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._work, args=(parallelizable,), daemon=True)
            for _ in range(num_workers)
        ]
        for thread in self._threads:
            thread.start()

    def _work(self, parallelizable: Any) -> None:
        while True:
            x = self._in.get()
            if x is self._STOP:
                return
            self._out.put(parallelizable.forward_backward(x))

    def put(self, x: Any) -> None:
        self._in.put(x)

    def get(self) -> Any:
        return self._out.get(timeout=60)

    def close(self) -> None:
        for _ in self._threads:
            self._in.put(self._STOP)
        for thread in self._threads:
            thread.join(10)


def bench_replicas(report: Report, quick: bool, repeat: int) -> None:
    batch, size = (16, 16) if quick else (64, 32)
    x = torch.randn(batch, 3, size, size)
    cnn = small_cnn()
    case = f"CNN fwd+bwd, batch {batch}x3x{size}x{size}"
    fns: dict[str, Callable[[], object]] = {"direct call (full batch)": lambda: step(cnn, x)}
    for n in (1, 2, 4):
        dp = ReplicationCallbackDataParallel(cnn, ["cpu"] * n)
        fns[f"RCDP n={n}"] = lambda dp=dp: step(dp, x)
    times = interleaved(fns, repeat=repeat)
    direct = times["direct call (full batch)"]
    for name, t in times.items():
        report.row(case, name, t, baseline=name.startswith("direct"))
    report.target("CNN fwd+bwd, 2 thread replicas vs direct call", times["RCDP n=2"] / direct, "<=", 1.3)
    for name, t in LAST_CPU.items():
        report.row(case + " (CPU time)", name, t, baseline=name.startswith("direct"))

    # Fixed overhead on a module that does nothing: everything but the compute.
    ident = nn.Identity()
    xs = torch.randn(batch, 8)
    fns = {"direct call": lambda: ident(xs)}
    for n in (2, 4):
        dp = ReplicationCallbackDataParallel(ident, ["cpu"] * n)
        fns[f"RCDP n={n}"] = lambda dp=dp: dp(xs)
    times = interleaved(fns, repeat=repeat * 5, warmup=5, number=10)
    for name, t in times.items():
        report.row("no-op module forward", name, t, baseline=name == "direct call")
    overhead = times["RCDP n=4"] - times["direct call"]
    report.target("fixed overhead per forward, n=4 (ms)", overhead * 1e3, "<=", 1.0, unit="ms")

    # The parts of the overhead, separately.
    modules = len(list(cnn.modules()))
    for n in (2, 4):
        t_rep = median_time(lambda n=n: _cpu.replicate_cpu(cnn, n), repeat=repeat * 5, warmup=5, number=20)
        report.row(f"replicate CNN ({modules} modules)", f"n={n}", t_rep)
        per = t_rep / (modules * n) * 1e6
        report.row("replication per module per replica", f"n={n}", per, unit="us")
        if n == 4:
            report.target("CPU replication per module per replica (us)", per, "<=", 10.0, unit="us")
        replicas = [nn.Identity() for _ in range(n)]
        inputs = [(torch.zeros(1),)] * n
        t_apply = median_time(
            lambda r=replicas, i=inputs: _apply.apply_replicas(r, i), repeat=repeat * 5, warmup=5, number=20
        )
        report.row("thread start/join (no-op replicas)", f"n={n}", t_apply)
        pool = ReplicaThreads()  # what ReplicationCallbackDataParallel keeps between forwards
        t_pooled = median_time(
            lambda r=replicas, i=inputs, p=pool: _apply.apply_replicas(r, i, threads=p),
            repeat=repeat * 5,
            warmup=5,
            number=20,
        )
        pool.close()
        report.row("apply on kept threads (no-op replicas)", f"n={n}", t_pooled)
        t_scatter = median_time(
            lambda n=n: _cpu.gather([o[0] for o in _cpu.scatter_kwargs((xs,), {}, n, 0)[0]], 0),
            repeat=repeat * 5,
            warmup=5,
            number=20,
        )
        report.row("scatter + gather", f"n={n}", t_scatter)


def run_items(parallel: Any, items: list[Any]) -> None:
    for item in items:
        parallel.put(item)
    for _ in items:
        parallel.get()


def _parallel_fns(
    work: Parallelizable, items: list[Any], stack: contextlib.ExitStack
) -> dict[str, Callable[[], object]]:
    fns: dict[str, Callable[[], object]] = {"serial loop": lambda: [work.forward_backward(i) for i in items]}
    for workers in (0, 1, 2, 4):
        parallel = stack.enter_context(Parallel(workers, work, serial_init=False))
        fns[f"pc Parallel workers={workers}"] = lambda p=parallel: run_items(p, items)
    gluon = GluonParallel(2, work)
    stack.callback(gluon.close)
    fns["gluon-style port workers=2"] = lambda: run_items(gluon, items)
    return fns


def bench_parallel(report: Report, quick: bool, repeat: int) -> None:
    count = 8 if quick else 32
    # No-op items: the pure cost of one put/get pair.
    items: list[Any] = list(range(count))
    with contextlib.ExitStack() as stack:
        times = interleaved(_parallel_fns(NoOp(), items, stack), repeat=repeat * 2, warmup=5)
    case = f"no-op, per item of {count}"
    for name, t in times.items():
        report.row(case, name, t / count, baseline=name == "serial loop")
    per_pair = (times["pc Parallel workers=2"] - times["serial loop"]) / count
    report.target("Parallel cost per put/get pair, 2 workers (us)", per_pair * 1e6, "<=", 100.0, unit="us")

    # MLP forward + backward on a shared module.
    batch = 32 if quick else 128
    xs = [torch.randn(batch, 64) for _ in range(count)]
    with contextlib.ExitStack() as stack:
        times = interleaved(_parallel_fns(MLPStep(mlp()), xs, stack), repeat=repeat)
    case = f"MLP fwd+bwd, {count} items of {batch}"
    for name, t in times.items():
        report.row(case, name, t, baseline=name == "serial loop")
    inline = times["pc Parallel workers=0"] / times["serial loop"]
    report.target("Parallel num_workers=0 vs a plain loop (MLP)", inline, "<=", 1.05)
    for name, t in LAST_CPU.items():
        report.row(case + " (CPU time)", name, t, baseline=name == "serial loop")
    inline_cpu = LAST_CPU["pc Parallel workers=0"] / LAST_CPU["serial loop"]
    report.target("Parallel num_workers=0 vs a plain loop (MLP, CPU time)", inline_cpu, "<=", 1.05)


def main() -> None:
    args = bench_args("pc-replicate")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    report = Report("pc-replicate")
    repeat = 20 if args.quick else 40
    try:
        bench_replicas(report, args.quick, repeat)
        bench_parallel(report, args.quick, repeat)
    finally:
        torch.set_num_threads(previous)
    report.note(
        "all timings with torch.set_num_threads(1); medians of >= 20 runs; ratios against the baseline row"
    )
    report.note(
        "CUDA targets (step within 2% of torch.nn.DataParallel on 2-8 GPUs) not measured: no GPU here"
    )
    report.finish(args)


if __name__ == "__main__":
    main()
