"""Shared helpers for the pc benchmarks: timing by medians, ratio tables, targets and JSON.

Every package's ``packages/pc-<name>/benchmarks/run.py`` builds one :class:`Report`, adds measurements of our
code and of its peers taken in the same run, states its targets with :meth:`Report.target`, prints the table
and writes JSON (``--out``). ``benchmarks/run_all.py`` (``nox -s bench``) combines the JSON files into one
report.

Usage in a benchmark script::

    import sys, pathlib
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
    from benchlib import Report, bench_args, median_time

    args = bench_args("pc-pickle")
    report = Report("pc-pickle")
    t_ours = median_time(lambda: ours(), repeat=5)
    t_peer = median_time(lambda: peer(), repeat=5)
    report.row("100 MB tensor", "pc_pickle", t_ours)
    report.row("100 MB tensor", "pickle5", t_peer, baseline=True)
    report.target("(a) 100 MB tensor vs pickle5", t_ours / t_peer, "<=", 0.5)
    report.finish(args)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "Report",
    "Row",
    "Target",
    "bench_args",
    "interleaved_min",
    "interleaved_samples",
    "median_time",
]


def bench_args(package: str, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the common benchmark flags: ``--out PATH`` (JSON) and ``--quick`` (smaller sizes)."""
    parser = argparse.ArgumentParser(description=f"{package} benchmarks (our code and its peers, one run)")
    parser.add_argument("--out", default=None, help="write the results as JSON to this path")
    parser.add_argument("--quick", action="store_true", help="fewer repeats and smaller sizes (smoke run)")
    return parser.parse_args(argv)


def median_time(fn: Callable[[], Any], *, repeat: int = 5, warmup: int = 1, number: int = 1) -> float:
    """Median wall time in seconds of ``number`` calls of ``fn``, divided by ``number``."""
    if repeat < 1 or number < 1:
        raise ValueError(f"repeat and number must be >= 1, got repeat={repeat}, number={number}")
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - start) / number)
    return statistics.median(samples)


def interleaved_samples(
    fns: dict[str, Callable[[], Any]],
    repeat: int,
    number: int = 1,
    sync: Callable[[], Any] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    warmup: int = 1,
) -> dict[str, list[float]]:
    """Per variant, the mean time of ``number`` calls in each of ``repeat`` interleaved rounds.

    The variants run round by round, in reverse order every other round, so a load drift and the position
    in a round (caches warmed or evicted by the variant before) hit them all alike. Each variant is called
    ``warmup`` times first. ``sync`` (e.g. ``torch.cuda.synchronize``) runs after the warm-up and after each
    variant's calls, inside the timing. ``clock`` is wall time by default; ``time.thread_time`` measures the
    CPU time of single-threaded work, which other processes on a shared machine do not inflate.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    if sync is not None:
        sync()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    for r in range(repeat):
        for name, fn in order if r % 2 == 0 else order[::-1]:
            start = clock()
            for _ in range(number):
                fn()
            if sync is not None:
                sync()
            samples[name].append((clock() - start) / number)
    return samples


def interleaved_min(
    fns: dict[str, Callable[[], Any]],
    repeat: int,
    number: int = 1,
    sync: Callable[[], Any] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Per variant, the min over ``repeat`` interleaved rounds of the mean time of ``number`` calls.

    See :func:`interleaved_samples` for the rounds, ``sync`` and ``clock``.
    """
    return {name: min(s) for name, s in interleaved_samples(fns, repeat, number, sync, clock).items()}


@dataclass
class Row:
    """One measurement: a case, an implementation, a value and its unit (lower is better unless noted)."""

    case: str
    impl: str
    value: float
    unit: str = "s"
    baseline: bool = False
    ratio: float | None = None
    higher_is_better: bool = False


@dataclass
class Target:
    """A target from the package's issue, with the measured value and whether it was met."""

    name: str
    measured: float
    op: str
    bound: float
    unit: str = "x"
    met: bool = False
    note: str = ""


@dataclass
class Report:
    """The measurements and targets of one package's benchmark run."""

    package: str
    rows: list[Row] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def row(
        self,
        case: str,
        impl: str,
        value: float,
        unit: str = "s",
        *,
        baseline: bool = False,
        higher_is_better: bool = False,
    ) -> Row:
        """Record one measurement; ratios are computed against the case's baseline row at the end."""
        r = Row(case, impl, float(value), unit, baseline, None, higher_is_better)
        self.rows.append(r)
        return r

    def target(
        self, name: str, measured: float, op: str, bound: float, unit: str = "x", note: str = ""
    ) -> Target:
        """State a target (``op`` is ``"<="`` or ``">="``) and whether the measured value meets it."""
        if op not in ("<=", ">="):
            raise ValueError(f"op must be '<=' or '>=', got {op!r}")
        met = measured <= bound if op == "<=" else measured >= bound
        t = Target(name, float(measured), op, float(bound), unit, bool(met), note)
        self.targets.append(t)
        return t

    def note(self, text: str) -> None:
        """Attach a free-text note (e.g. what could not be measured on this machine and why)."""
        self.notes.append(text)

    def _compute_ratios(self) -> None:
        baselines = {r.case: r.value for r in self.rows if r.baseline}
        for r in self.rows:
            base = baselines.get(r.case)
            if base:
                r.ratio = r.value / base

    def table(self) -> str:
        """The measurements and targets as a plain-text table."""
        self._compute_ratios()
        lines = [f"== {self.package} ==", f"{'case':44} {'impl':26} {'value':>14} {'ratio':>8}"]
        for r in self.rows:
            ratio = "base" if r.baseline else (f"{r.ratio:.3f}" if r.ratio is not None else "")
            lines.append(f"{r.case[:44]:44} {r.impl[:26]:26} {r.value:>12.6g} {r.unit:<2}{ratio:>7}")
        if self.targets:
            lines.append("-- targets --")
            for t in self.targets:
                status = "MET" if t.met else "NOT MET"
                lines.append(
                    f"{t.name[:60]:60} {t.measured:>10.4g}{t.unit} {t.op} {t.bound:g}{t.unit}  {status}"
                )
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict with the environment, rows, targets and notes."""
        self._compute_ratios()
        return {
            "package": self.package,
            "environment": {
                "python": sys.version.split()[0],
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "torch": _torch_version(),
                "gpu": _gpu_name(),
            },
            "rows": [asdict(r) for r in self.rows],
            "targets": [asdict(t) for t in self.targets],
            "notes": list(self.notes),
        }

    def finish(self, args: argparse.Namespace) -> None:
        """Print the table and write JSON when ``--out`` was given."""
        print(self.table(), flush=True)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as fh:
                json.dump(self.to_json(), fh, indent=2)


def _torch_version() -> str | None:
    torch = sys.modules.get("torch")
    return getattr(torch, "__version__", None)


def _gpu_name() -> str | None:
    """The first CUDA device's name when this run used CUDA (a run that did not initialise CUDA says None)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return str(torch.cuda.get_device_name(0))
