"""Scaling curves of issue 20: throughput against processes (1, 2, 4) and simulated hosts (1, 2, 3).

Two workloads (scaling_worker.py, both in every job): the gradient server (PushPullGradServerImpl, every rank
a client and a secondary reducer, the primary on rank 0; pushes/s of all clients together) and DataParallel
(blocking, the 2.1M-parameter MLP, a fixed batch per process; samples/s of all processes together). Both are
weak scaling: the work per process is fixed, so the ideal throughput at N is N times the throughput at 1.

- processes: one ``torchrun --standalone --nproc_per_node N`` on this machine (N = 1, 2, 4);
- hosts: the multi-host harness (tests-integration/multihost.py: network namespaces on one bridge, one
  torchrun per simulated host, static rendezvous), one process per host (H = 1, 2, 3). Needs root and
  ``ip netns``; without them the host curves are reported as not measured, with the reason.

The jobs run in rounds (every point once per round); each point is the best of its repetitions (the highest
throughput: the least disturbed by other work on a shared machine, as the minimum times of
benchlib.interleaved_min), drawn with the lowest and the highest. Weak-scaling efficiency is
``throughput(N) / (N * throughput(1))`` (ideal 1) and, because every simulated host and process shares this
machine's cores, also ``throughput(N) / (min(N, cores) * throughput(1))``: the efficiency against the cores
actually available.

A curve is a target without a bound (the issue gives none): it is met when every point was measured; its value
is the efficiency at the largest point.

Usage: ``python benchmarks/scaling/run.py [--quick] [--out PATH]`` (``benchmarks/run_all.py scaling``).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchlib
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests-integration"))  # the harness

import torch  # noqa: F401  (benchlib records its version)
from benchlib import Report, bench_args
from multihost import SimHosts, TorchrunJob, unavailable_reason

HERE = pathlib.Path(__file__).resolve().parent
WORKER = str(HERE / "scaling_worker.py")
JOB_TIMEOUT = 240.0
PROCESSES = (1, 2, 4)
HOSTS = (1, 2, 3)
WHAT = {
    "gs": ("gradient server (pushes/s)", "pushes/s"),
    "dp": ("DataParallel (samples/s)", "samples/s"),
}
AXIS = {"processes": "processes (1, 2, 4)", "hosts": "hosts (1, 2, 3)"}


def _read(out: pathlib.Path, logs: str) -> dict[str, Any]:
    path = out / "result.json"
    if not path.exists():
        raise RuntimeError(f"the job wrote no result; log tail:\n{logs[-3000:]}")
    return dict(json.loads(path.read_text()))


def run_processes(points: tuple[int, ...], args: list[str]) -> dict[str, Any]:
    """One ``torchrun --standalone`` job of ``max(points)`` processes on this machine."""
    with tempfile.TemporaryDirectory(prefix="pc-scaling-") as tmp:
        out = pathlib.Path(tmp)
        log = out / "torchrun.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        n = max(points)
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                [*argv, WORKER, str(out), ",".join(map(str, points)), *args],
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            code = proc.wait(JOB_TIMEOUT)
        except subprocess.TimeoutExpired:
            code = -1
        finally:
            if proc.poll() is None or code != 0:
                with contextlib.suppress(ProcessLookupError):  # the job's session: torchrun, its workers
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        text = log.read_text(errors="replace")
        if code != 0:
            raise RuntimeError(f"torchrun exited with {code}; log tail:\n{text[-3000:]}")
        return _read(out, text)


def run_hosts(points: tuple[int, ...], args: list[str]) -> dict[str, Any]:
    """One job on ``max(points)`` simulated hosts (network namespaces), one process each."""
    with tempfile.TemporaryDirectory(prefix="pc-scaling-") as tmp, SimHosts(max(points)) as hosts:
        out = pathlib.Path(tmp)
        script = [WORKER, str(out), ",".join(map(str, points)), *args]
        job = TorchrunJob(hosts, script, out, nproc_per_node=1)
        codes = job.wait(JOB_TIMEOUT)
        if any(codes):
            raise RuntimeError(f"torchrun exit codes {codes}\n{job.all_logs()}")
        return _read(out, job.all_logs())


def split(result: dict[str, Any], load: float) -> dict[int, dict[str, Any]]:
    """A job's result per point: per repetition, pushes/s applied of all clients together and samples/s of
    all processes together, with rank 0's times and counters."""
    per_point = {}
    for key, reps in result["samples"].items():
        n = int(key)
        per_point[n] = {
            "gs": [n * result["pushes_per_client"] / r["push_s"] for r in reps],
            "gs_returned": [n * result["pushes_per_client"] / r["push_returned_s"] for r in reps],
            "dp": [n * result["batch"] * result["dp_steps"] / r["dp_s"] for r in reps],
            # CPU seconds of the N ranks together per push / per sample: the cost, whatever the load left
            "gs_cpu": [
                r.get("all_push_cpu_s", float("nan")) / (n * result["pushes_per_client"]) for r in reps
            ],
            "dp_cpu": [
                r.get("all_dp_cpu_s", float("nan")) / (n * result["batch"] * result["dp_steps"]) for r in reps
            ],
            "push_s": [r["push_s"] for r in reps],
            "push_cpu_s": [r["push_cpu_s"] for r in reps],
            "dp_s": [r["dp_s"] for r in reps],
            # CPU seconds of the point's N ranks together (absent in a result without them)
            "all_push_cpu_s": [r.get("all_push_cpu_s", float("nan")) for r in reps],
            "all_dp_cpu_s": [r.get("all_dp_cpu_s", float("nan")) for r in reps],
            "load": load,
            **result["counters"].get(key, {}),
        }
    return per_point


def measure(
    rounds: int, args: list[str], hosts_ok: bool
) -> tuple[dict[tuple[str, int], list[dict[str, Any]]], list[str]]:
    """One job per axis and round; returns ``{(axis, n): [per-point records]}`` and the errors."""
    axes = [("processes", PROCESSES)] + ([("hosts", HOSTS)] if hosts_ok else [])
    samples: dict[tuple[str, int], list[dict[str, Any]]] = {}
    errors: list[str] = []
    for r in range(rounds):
        for axis, points in axes:
            start, load = time.monotonic(), os.getloadavg()[0]
            try:
                run = run_processes if axis == "processes" else run_hosts
                result = run(points, args)
            except Exception as exc:  # a failed job fails its axis's curves, not the run
                errors.append(f"round {r + 1}, {axis}: {type(exc).__name__}: {str(exc)[-600:]}")
                print(errors[-1], flush=True)
                continue
            for n, record in split(result, load).items():
                samples.setdefault((axis, n), []).append(record)
                print(
                    f"round {r + 1}: {n} {axis}: {max(record['gs']):.1f} pushes/s, "
                    f"{max(record['dp']):.1f} samples/s",
                    flush=True,
                )
            print(f"round {r + 1}: {axis}: {time.monotonic() - start:.1f} s", flush=True)
    return samples, errors


def _cpu_share(records: list[dict[str, Any]], cpu: str = "push_cpu_s", wall: str = "push_s") -> float:
    """CPU seconds per wall second over every repetition: by default rank 0's (the primary reducer's) during
    the pushes; ``all_push_cpu_s`` / ``all_dp_cpu_s`` with ``dp_s``: the point's N ranks together."""
    if not records:
        return float("nan")
    return sum(sum(r[cpu]) for r in records) / sum(sum(r[wall]) for r in records)


def curve(
    key: str, axis: str, xs: tuple[int, ...], samples: dict[Any, Any], cores: int, why_not: str
) -> dict[str, Any]:
    """One curve: per point the best throughput over every repetition of every round, with min and max, and
    the efficiencies."""
    what, unit = WHAT[key]
    values = [[v for s in samples.get((axis, n), []) for v in s[key]] for n in xs]
    costs = [[v for s in samples.get((axis, n), []) for v in s.get(f"{key}_cpu", [])] for n in xs]
    cost = [min(c) if c else float("nan") for c in costs]
    complete = all(values) and not why_not
    med = [max(v) if v else float("nan") for v in values]  # the best repetition
    base = med[0]
    return {
        "name": f"{what} scaling over {AXIS[axis]}",
        "what": what,
        "axis": axis,
        "unit": unit,
        "x": list(xs),
        "throughput": med,
        "min": [min(v) if v else float("nan") for v in values],
        "max": [max(v) if v else float("nan") for v in values],
        "samples": [len(v) for v in values],
        "efficiency": [t / (n * base) for t, n in zip(med, xs, strict=True)],
        "efficiency_cores": [t / (min(n, cores) * base) for t, n in zip(med, xs, strict=True)],
        # CPU cost per unit of work at 1 / at N (the cheapest repetition of each): 1 when adding processes
        # adds no CPU work per push or sample, whatever share of the cores the machine's load left
        "cpu_per_unit": cost,
        "efficiency_cpu": [cost[0] / c for c in cost],
        "cores": cores,
        # CPU seconds per wall second during the push phases, rank 0 (the primary) and the others' mean
        "cpu_per_wall": [_cpu_share(samples.get((axis, n), [])) for n in xs] if key == "gs" else [],
        "complete": complete,
        "why_not": why_not or ("" if complete else "a point of the curve failed (see the notes)"),
    }


def main() -> None:
    args = bench_args("scaling")
    rounds, dp_steps, pushes, reps = (1, 6, 10, 2) if args.quick else (1, 15, 40, 4)
    cores = len(os.sched_getaffinity(0))
    hosts_reason = unavailable_reason()
    samples, errors = measure(rounds, [str(dp_steps), str(pushes), str(reps)], hosts_reason is None)
    report = Report("scaling")
    curves = []
    for key in WHAT:
        for axis, xs in (("processes", PROCESSES), ("hosts", HOSTS)):
            unavailable = axis == "hosts" and hosts_reason
            why_not = f"simulated hosts unavailable: {hosts_reason}" if unavailable else ""
            c = curve(key, axis, xs, samples, cores, why_not)
            curves.append(c)
            case = f"{c['what']} over {axis}"
            for i, n in enumerate(xs):
                if c["samples"][i]:
                    report.row(
                        case,
                        f"{n} {axis}",
                        c["throughput"][i],
                        c["unit"],
                        baseline=(i == 0),
                        higher_is_better=True,
                    )
            eff = ", ".join(
                f"{n}: {e:.2f} (cores: {ec:.2f})"
                for n, e, ec in zip(xs, c["efficiency"], c["efficiency_cores"], strict=True)
            )
            note = (
                c["why_not"]
                if not c["complete"]
                else f"weak-scaling efficiency by {axis} {eff}; ideal 1 at every point"
            )
            last = c["efficiency"][-1] if c["complete"] else float("nan")
            t = report.target(c["name"], last, ">=", 0.0, "")
            t.note = note
            t.met = bool(c["complete"])
    report.note(
        f"Weak scaling (fixed work per process) on {cores} cores shared by every process and every simulated "
        "host: beyond the cores the processes time-share them, so efficiency is given against the ideal "
        "(N x one process) and against the cores available (min(N, cores) x one process). The simulated "
        "hosts are network namespaces on one machine: their curve shows the protocol's overhead across a "
        "bridge, not a network's bandwidth."
    )
    report.note(
        f"One job per axis and round ({rounds} round(s)) measures every point of the axis, interleaved: "
        f"{reps} repetitions, each point in turn (the order reversed every other time), the first N ranks "
        "of the job making the point N while the others wait; the best repetition is shown, with min and "
        f"max. DataParallel: blocking, 2.1M-parameter MLP, {dp_steps} steps of a 64-sample batch per "
        f"process. Gradient server: {pushes} pushes of 100k floats per client, every rank a client and a "
        "secondary reducer, the primary on rank 0; pushes/s counts a push once the primary applied it "
        "(returned-only rates and drops below)."
    )
    report.note(
        "A curve's target has no bound (the issue gives none): met means every point was measured; its "
        "value is the weak-scaling efficiency at the largest point."
    )
    loads = sorted({f"{axis}: {s['load']:.1f}" for (axis, _), runs in samples.items() for s in runs})
    report.note(
        "Load average (1 min) of the machine as each job began, other work on it included: "
        + ", ".join(loads)
        + f" ({cores} cores). Under load every point measures lower; the interleaving keeps the ratios fair."
    )
    for axis, xs in (("processes", PROCESSES), ("hosts", HOSTS)):
        if all((axis, n) in samples for n in xs):
            used = "; ".join(
                f"{n}: {_cpu_share(samples[(axis, n)], 'all_dp_cpu_s', 'dp_s'):.2f} in DataParallel steps, "
                f"{_cpu_share(samples[(axis, n)], 'all_push_cpu_s'):.2f} in pushes"
                for n in xs
            )
            report.note(
                f"CPU seconds per wall second of the N ranks together (process_time, every thread), by "
                f"{axis}: {used}; at most {cores} on this machine, less under the other work's load."
            )
    for c in curves:
        if c["cpu_per_wall"] and c["complete"]:
            recs = [samples[(c["axis"], n)] for n in c["x"]]
            detail = "; ".join(
                f"{n}: rank 0 {share:.2f} CPU-s per s, returned "
                f"{max(v for r in rs for v in r['gs_returned']):.4g}"
                f" pushes/s, dropped {sum(r.get('dropped', 0) for r in rs):g} of"
                f" {sum(r.get('applied', 0) + r.get('dropped', 0) for r in rs):g}"
                for n, share, rs in zip(c["x"], c["cpu_per_wall"], recs, strict=True)
            )
            report.note(
                f"{c['name']}: rank 0 (the primary reducer, the ordered server every pull asks, a secondary "
                f"and a client) during the pushes, CPU seconds per wall second (process_time, every thread), "
                f"the best rate at which pushes returned (queued), and the pushes dropped: {detail}."
            )
    for err in errors:
        report.note(f"failed: {err}")
    print(report.table(), flush=True)
    if args.out:
        data = report.to_json()
        for t in data["targets"]:
            t["curve"] = True
        data["curves"] = curves
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(data, indent=2))


if __name__ == "__main__":
    main()
