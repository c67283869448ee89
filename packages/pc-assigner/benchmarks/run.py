"""pc-assigner benchmark: solution quality and runtime on the stored suite, beside machin's gradient descent.

    python packages/pc-assigner/benchmarks/run.py [--quick] [--out results.json]

Every instance's cost is judged against a **proven lower bound** stored in ``optima/`` (``make_optima.py``):
the optimum itself where exhaustive search or HiGHS (relative gap 1e-7) proved it, HiGHS's dual bound where
its time limit stopped it. So a ratio is never flattering: ``cost / bound >= cost / optimum``. For each
instance we run ``solve_placement(method="auto")`` (ours), ``method="heuristic"`` (greedy + local search +
restarts alone) and a re-implementation of machin's gradient descent with its defaults (500 Adam steps, sizes
in MiB, complexity = size, soft memory, argmax without repair). Costs use alpha = beta = 1; a placement over
a device's memory counts as infeasible. Runtimes are the minimum of interleaved repetitions
(benchlib.interleaved_min) in CPU time of the solving thread: every solver here is single-threaded (torch on
one thread), and on the shared machine wall time would count other processes' turns.

The n = 200 instances (``suite.large_suite``) have no proven optimum; they are judged against
``pc_assigner._bound.hub_lower_bound``: the LP relaxation (scipy's HiGHS) with the placements of the two
items with the most traffic enumerated, the minimum over them (a valid lower bound: the optimum is a feasible
point of the LP of its own hub placement; the argument is in that module's docstring). The plain LP
relaxation charges traffic only where an item cannot be split across devices, so on hub-and-spoke traffic it
bounds the makespan alone; the report gives cost over the plain LP and the makespan term alone over the
bound as well.

``--quick`` keeps n <= 12 (machin GD on n = 4) and two n = 200 instances. Torch runs on one thread.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "benchmarks"))
sys.path.insert(0, str(HERE))
from benchlib import Report, bench_args, interleaved_min  # noqa: E402
from suite import large_suite  # noqa: E402
from tqdm import tqdm  # noqa: E402

from pc_assigner import PlacementProblem, placement_cost, solve_placement  # noqa: E402
from pc_assigner._bound import hub_lower_bound  # noqa: E402
from pc_assigner._core import compile_problem  # noqa: E402
from pc_assigner._gd import gradient_search  # noqa: E402
from pc_assigner._ilp import lp_lower_bound  # noqa: E402

PROVEN = ("exhaustive", "ilp")


def _q(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _machin_gd(p: PlacementProblem) -> tuple[int, ...]:
    c = compile_problem(p)
    # machin: complexity = size (MiB), device capacity = free memory, speeds = cpu_weight or 1 - load
    sizes = tuple(s / 2**20 for s in c.size)
    speeds = tuple(p.speeds[j] for j in c.devices)
    return c.expand(gradient_search(c, seed=0, complexity=sizes, speeds=speeds))


def _keep(out: dict[str, tuple[int, ...]], key: str, p: PlacementProblem, how: str) -> Callable[[], None]:
    """A timed call that stores its placement in ``out[key]``."""

    def call() -> None:
        if how == "machin_gd":
            out[key] = _machin_gd(p)
        else:
            out[key] = solve_placement(p, method=how).assignment  # type: ignore[arg-type]

    return call


def _suite_rows(report: Report, records: list[dict], quick: bool) -> None:  # type: ignore[type-arg]
    gd_max_n = 4 if quick else 8
    repeat = 1 if quick else 3
    stats: dict[str, dict[str, list[float]]] = {
        k: {"ratio": [], "time": [], "infeasible": [], "time16": [], "proven_ratio": [], "bound_ratio": []}
        for k in ("auto", "heuristic", "machin_gd")
    }
    proofs = 0
    slow: list[str] = []
    deterministic = True
    solve_placement(PlacementProblem.from_dict(records[0]["problem"]))  # warm up once
    for rec in tqdm(records, desc="instances", disable=None):
        p = PlacementProblem.from_dict(rec["problem"])
        n, bound = rec["params"]["n"], rec["bound"]
        out: dict[str, tuple[int, ...]] = {}
        times = interleaved_min(
            {"auto": _keep(out, "auto", p, "auto"), "heuristic": _keep(out, "heuristic", p, "heuristic")},
            repeat=repeat,
            clock=time.thread_time,
        )
        if n <= gd_max_n:
            t_gd = interleaved_min(
                {"gd": _keep(out, "machin_gd", p, "machin_gd")}, repeat=1, clock=time.thread_time
            )
            times["machin_gd"] = t_gd["gd"]
        for name, a in out.items():
            cost = placement_cost(p, a)
            st = stats[name]
            st["infeasible"].append(0.0 if cost.feasible else 1.0)
            st["time"].append(times[name])
            if n <= 16:
                st["time16"].append(times[name])
                if name == "auto" and times[name] > 0.020:
                    slow.append(f"n{n}-m{rec['params']['m']}")
            if cost.feasible:
                ratio = cost.total / bound
                st["ratio"].append(ratio)
                (st["proven_ratio"] if rec["proof"] in PROVEN else st["bound_ratio"]).append(ratio)
        result = solve_placement(p)
        proofs += result.optimal
        deterministic &= result.assignment == out["auto"]
    labels = {
        "auto": "pc_assigner auto",
        "heuristic": "pc_assigner heuristic",
        "machin_gd": "machin GD (peer)",
    }
    for name, st in stats.items():
        if not st["time"]:
            continue
        base, tag = name == "machin_gd", labels[name]
        ratios = st["ratio"] or [math.nan]
        report.row("mean cost/bound (feasible ones)", tag, statistics.mean(ratios), "x", baseline=base)
        report.row("p90 cost/bound", tag, _q(ratios, 0.9), "x", baseline=base)
        report.row("max cost/bound", tag, max(ratios), "x", baseline=base)
        report.row(
            "fraction optimal (<= 1 + 1e-7 of the bound)",
            tag,
            sum(r <= 1 + 1e-7 for r in ratios) / len(st["time"]),
            "",
            baseline=base,
            higher_is_better=True,
        )
        report.row("infeasible rate", tag, statistics.mean(st["infeasible"]), "", baseline=base)
        report.row("p50 runtime (CPU time)", tag, _q(st["time"], 0.5), "s", baseline=base)
        report.row("p95 runtime (CPU time)", tag, _q(st["time"], 0.95), "s", baseline=base)
    a = stats["auto"]
    n_proven = len(a["proven_ratio"])
    report.note(
        f"{len(records)} instances, {n_proven} with a proven optimum; machin GD on the "
        f"{len(stats['machin_gd']['time'])} with n <= {gd_max_n}; auto proved its own placement optimal on "
        f"{proofs} of {len(records)}"
    )
    if a["bound_ratio"]:
        report.note(
            f"on the {len(a['bound_ratio'])} instances HiGHS could not prove in 60 s, auto's cost / HiGHS's "
            f"dual bound: mean {statistics.mean(a['bound_ratio']):.4f}, max {max(a['bound_ratio']):.4f} "
            "(an upper bound on the true ratio)"
        )
    report.target("infeasible placements (auto)", sum(a["infeasible"]), "<=", 0, unit="")
    report.target("mean cost / proven optimum (auto)", statistics.mean(a["proven_ratio"]), "<=", 1.001)
    report.target("max cost / proven optimum (auto)", max(a["proven_ratio"]), "<=", 1.02)
    t16 = _q(a["time16"], 0.95)
    report.target(
        "p95 runtime of auto for n <= 16",
        t16,
        "<=",
        0.020,
        unit="s",
        note=""
        if t16 <= 0.020
        else f"{len(slow)} of {len(a['time16'])} instances took over 20 ms ({', '.join(sorted(slow))}): "
        "branch and bound bounds tens of thousands of partial placements to prove those optima; "
        + _load_note(),
    )
    report.target("determinism (same seed, same result)", 1.0 if deterministic else 0.0, ">=", 1.0, unit="")
    gd = stats["machin_gd"]["infeasible"]
    report.note(
        f"machin GD (peer) returned a placement over memory on {statistics.mean(gd):.1%} of its instances"
    )


def _load_note() -> str:
    load = os.getloadavg()[0]
    return f"measured with load average {load:.1f} on {os.cpu_count()} CPUs (other processes share them)"


def _large_rows(report: Report, quick: bool) -> None:
    ratios, lp_ratios, makespan_ratios, times = [], [], [], []
    for name, _params, p in tqdm(large_suite(quick), desc="n = 200", disable=None):
        c = compile_problem(p)
        lp = lp_lower_bound(c)
        bound = hub_lower_bound(c)
        out: dict[str, tuple[int, ...]] = {}
        t = interleaved_min({"auto": _keep(out, "auto", p, "auto")}, repeat=2, clock=time.thread_time)
        cost = placement_cost(p, out["auto"])
        family = name.split("-")[2] + "-" + name.split("-")[4]
        report.row(f"n = 200 {family}: cost / lower bound", "pc_assigner auto", cost.total / bound, "x")
        report.row(f"n = 200 {family}: cost / plain LP relaxation", "pc_assigner auto", cost.total / lp, "x")
        report.row(f"n = 200 {family}: runtime (CPU time)", "pc_assigner auto", t["auto"], "s")
        ratios.append(cost.total / bound)
        lp_ratios.append(cost.total / lp)
        makespan_ratios.append(p.alpha * cost.makespan / bound)
        times.append(t["auto"])
    worst = max(range(len(ratios)), key=lambda i: ratios[i])
    why = (
        f"the worst instance's makespan term alone is {makespan_ratios[worst]:.3f}x the bound, so the excess "
        "is traffic: the bound charges the edges of the two busiest items only, and no exact optimum is "
        "known at n = 200 to separate the bound's share of the gap from the search's"
    )
    report.note(
        "n = 200 lower bound: the LP relaxation with the two items of most traffic placed integrally, the "
        "minimum over their placements (pc_assigner._bound.hub_lower_bound); against the plain LP relaxation "
        f"the worst ratio is {max(lp_ratios):.3f} (it charges no traffic where items can be split)"
    )
    report.target(
        "n = 200: cost / LP lower bound", max(ratios), "<=", 1.05, note="" if max(ratios) <= 1.05 else why
    )
    report.target(
        "n = 200: runtime of auto",
        max(times),
        "<=",
        1.0,
        unit="s",
        note=""
        if max(times) <= 1.0
        else "local search prices O(n^2) swaps per pass (numpy, blocks of rows); " + _load_note(),
    )


def main() -> None:
    args = bench_args("pc-assigner")
    import torch

    torch.set_num_threads(1)
    report = Report("pc-assigner")
    records = [json.loads(f.read_text()) for f in sorted((HERE / "optima").glob("*.json"))]
    records = [
        r for r in records if r["proof"] != "infeasible" and (not args.quick or r["params"]["n"] <= 12)
    ]
    _suite_rows(report, records, args.quick)
    _large_rows(report, args.quick)
    report.note(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    report.finish(args)


if __name__ == "__main__":
    main()
