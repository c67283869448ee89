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


def run_processes(n: int, dp_steps: int, pushes: int, reps: int) -> dict[str, Any]:
    """One ``torchrun --standalone`` job of ``n`` processes on this machine."""
    with tempfile.TemporaryDirectory(prefix="pc-scaling-") as tmp:
        out = pathlib.Path(tmp)
        log = out / "torchrun.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                [*argv, WORKER, str(out), str(dp_steps), str(pushes), str(reps)],
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


def run_hosts(n: int, dp_steps: int, pushes: int, reps: int) -> dict[str, Any]:
    """One job on ``n`` simulated hosts (network namespaces), one process each."""
    with tempfile.TemporaryDirectory(prefix="pc-scaling-") as tmp, SimHosts(n) as hosts:
        out = pathlib.Path(tmp)
        script = [WORKER, str(out), str(dp_steps), str(pushes), str(reps)]
        job = TorchrunJob(hosts, script, out, nproc_per_node=1)
        codes = job.wait(JOB_TIMEOUT)
        if any(codes):
            raise RuntimeError(f"torchrun exit codes {codes}\n{job.all_logs()}")
        return _read(out, job.all_logs())


def _throughputs(result: dict[str, Any]) -> dict[str, list[float]]:
    """Per repetition: pushes/s of all clients together and samples/s of all processes together."""
    size = result["world_size"]
    return {
        "gs": [size * result["pushes_per_client"] / s for s in result["push_s"]],
        "dp": [size * result["batch"] * result["dp_steps"] / s for s in result["dp_s"]],
    }


def measure(
    rounds: int, dp_steps: int, pushes: int, reps: int, hosts_ok: bool
) -> tuple[dict[Any, Any], list[str]]:
    """Every point once per round; returns ``{(axis, n): [job results]}`` and the errors."""
    points: list[tuple[str, int]] = [("processes", n) for n in PROCESSES]
    if hosts_ok:
        points += [("hosts", n) for n in HOSTS]
    samples: dict[tuple[str, int], list[dict[str, Any]]] = {p: [] for p in points}
    errors: list[str] = []
    for r in range(rounds):
        for axis, n in points:
            start, load = time.monotonic(), os.getloadavg()[0]
            try:
                run = run_processes if axis == "processes" else run_hosts
                result = run(n, dp_steps, pushes, reps)
            except Exception as exc:  # one failed point fails its curve, not the run
                errors.append(f"round {r + 1}, {n} {axis}: {type(exc).__name__}: {str(exc)[-600:]}")
                print(errors[-1], flush=True)
                continue
            result.update(_throughputs(result), load=load)
            samples[(axis, n)].append(result)
            print(
                f"round {r + 1}: {n} {axis}: {max(result['gs']):.1f} pushes/s, "
                f"{max(result['dp']):.1f} samples/s "
                f"({time.monotonic() - start:.1f} s)",
                flush=True,
            )
    return samples, errors


def _cpu_shares(jobs: list[dict[str, Any]]) -> list[float]:
    """Rank 0's and the other ranks' (mean) CPU seconds per wall second of the push phases."""
    if not jobs:
        return []
    job = jobs[0]
    wall = sum(job["push_s"])
    cpu = job["push_cpu_s"]
    others = cpu[1:]
    return [cpu[0] / wall, sum(others) / len(others) / wall if others else float("nan")]


def curve(
    key: str, axis: str, xs: tuple[int, ...], samples: dict[Any, Any], cores: int, why_not: str
) -> dict[str, Any]:
    """One curve: per point the best throughput over every repetition of every round, with min and max, and
    the efficiencies."""
    what, unit = WHAT[key]
    values = [[v for s in samples.get((axis, n), []) for v in s[key]] for n in xs]
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
        "cores": cores,
        # CPU seconds per wall second during the push phases, rank 0 (the primary) and the others' mean
        "cpu_per_wall": [_cpu_shares(samples.get((axis, n), [])) for n in xs] if key == "gs" else [],
        "complete": complete,
        "why_not": why_not or ("" if complete else "a point of the curve failed (see the notes)"),
    }


def main() -> None:
    args = bench_args("scaling")
    rounds, dp_steps, pushes, reps = (1, 10, 20, 1) if args.quick else (1, 15, 40, 6)
    cores = len(os.sched_getaffinity(0))
    hosts_reason = unavailable_reason()
    samples, errors = measure(rounds, dp_steps, pushes, reps, hosts_reason is None)
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
            for i, n in enumerate(xs[1:], start=1):
                if c["samples"][i]:
                    eff_case = f"{case}: weak-scaling efficiency (ideal 1)"
                    report.row(eff_case, f"{n} {axis}: vs ideal", c["efficiency"][i], "")
                    cores_n = min(n, cores)
                    report.row(eff_case, f"{n} {axis}: vs {cores_n} cores", c["efficiency_cores"][i], "")
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
        f"{rounds} round(s) of every point, {reps} repetition(s) in each job (after its warm-up), the best "
        "of them shown with min and max; DataParallel: blocking, 2.1M-parameter MLP, "
        f"{dp_steps} steps of a 64-sample batch per process; gradient server: {pushes} pushes of 100k floats "
        "per client, every rank a client and a secondary reducer, the primary on rank 0."
    )
    report.note(
        "A curve's target has no bound (the issue gives none): met means every point was measured; its "
        "value is the weak-scaling efficiency at the largest point."
    )
    loads = {f"{n} {axis}": s["load"] for (axis, n), runs in samples.items() for s in runs}
    report.note(
        "Load average (1 min) of the machine as each job began, other work on it included: "
        + ", ".join(f"{k}: {v:.1f}" for k, v in loads.items())
        + f" ({cores} cores). A job that began under more load measures lower; rerun on a quiet machine."
    )
    for c in curves:
        if c["cpu_per_wall"] and c["complete"]:
            shares = "; ".join(
                f"{n}: rank 0 {s[0]:.2f}" + (f", others {s[1]:.2f}" if n > 1 else "")
                for n, s in zip(c["x"], c["cpu_per_wall"], strict=True)
                if s
            )
            report.note(
                f"{c['name']}: CPU seconds per wall second during the pushes (process_time, every thread; "
                f"rank 0 holds the primary reducer, the ordered server every pull asks, a secondary and a "
                f"client): {shares}; {cores} cores in all."
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
