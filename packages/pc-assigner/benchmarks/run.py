"""pc-assigner benchmark: solution quality and runtime on the stored suite, beside machin's gradient descent.

    python packages/pc-assigner/benchmarks/run.py [--quick] [--out results.json]

Every instance's optimal cost is stored in ``optima/`` (``make_optima.py``, exhaustive search or HiGHS), so
this needs no solver. For each instance we run ``solve_placement(method="auto")`` (ours),
``method="heuristic"`` (greedy + local search + restarts alone, to show its quality where "auto" searched
exhaustively) and a re-implementation of machin's gradient descent with its defaults (500 Adam steps, sizes
in MiB, complexity = size, soft memory, argmax without repair). Costs are judged with alpha = beta = 1; a
placement over a device's memory counts as infeasible. ``--quick`` keeps n <= 12 (and n = 4 for the gradient
peer, n <= 8 otherwise). Torch runs on one thread here: the tensors are tiny and the machines are shared.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "benchmarks"))
from benchlib import Report, bench_args  # noqa: E402
from tqdm import tqdm  # noqa: E402

from pc_assigner import PlacementProblem, placement_cost, solve_placement  # noqa: E402
from pc_assigner._core import compile_problem  # noqa: E402
from pc_assigner._gd import gradient_search  # noqa: E402


def _q(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _machin_gd(p: PlacementProblem) -> tuple[int, ...]:
    c = compile_problem(p)
    # machin: complexity = size (MiB), device capacity = free memory, speeds = cpu_weight or 1 - load
    sizes = tuple(s / 2**20 for s in c.size)
    speeds = tuple(p.speeds[j] for j in c.devices)
    return c.expand(gradient_search(c, seed=0, complexity=sizes, speeds=speeds))


def _timed(fn, repeat: int) -> tuple[object, float]:  # type: ignore[no-untyped-def]
    out, samples = None, []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        samples.append(time.perf_counter() - t0)
    return out, statistics.median(samples)


def main() -> None:
    args = bench_args("pc-assigner")
    import torch

    torch.set_num_threads(1)
    report = Report("pc-assigner")
    records = [json.loads(f.read_text()) for f in sorted((HERE / "optima").glob("*.json"))]
    records = [
        r for r in records if r["proof"] != "infeasible" and (not args.quick or r["params"]["n"] <= 12)
    ]
    gd_max_n = 4 if args.quick else 8
    repeat = 1 if args.quick else 3
    stats: dict[str, dict[str, list[float]]] = {
        k: {"ratio": [], "time": [], "infeasible": [], "small_ratio": [], "time16": []}
        for k in ("auto", "heuristic", "machin_gd")
    }
    exact_ratios: list[float] = []
    deterministic = True
    solve_placement(PlacementProblem.from_dict(records[0]["problem"]))  # warm torch up once
    for rec in tqdm(records, desc="instances", disable=None):
        p = PlacementProblem.from_dict(rec["problem"])
        n, m, opt = rec["params"]["n"], rec["params"]["m"], rec["cost"]
        runs = {
            "auto": lambda p=p: solve_placement(p).assignment,
            "heuristic": lambda p=p: solve_placement(p, method="heuristic").assignment,
        }
        if n <= gd_max_n:
            runs["machin_gd"] = lambda p=p: _machin_gd(p)
        for name, fn in runs.items():
            a, t = _timed(fn, repeat if name != "machin_gd" else 1)
            cost = placement_cost(p, a)  # type: ignore[arg-type]
            st = stats[name]
            st["infeasible"].append(0.0 if cost.feasible else 1.0)
            st["time"].append(t)
            if n <= 16:
                st["time16"].append(t)
            if cost.feasible:
                st["ratio"].append(cost.total / opt)
                if n <= 10:
                    st["small_ratio"].append(cost.total / opt)
            if name == "auto":
                if m**n <= 1_000_000:
                    exact_ratios.append(cost.total / opt)
                deterministic &= solve_placement(p).assignment == a
    labels = {
        "auto": "pc_assigner auto",
        "heuristic": "pc_assigner heuristic",
        "machin_gd": "machin GD (peer)",
    }
    for name, st in stats.items():
        if not st["time"]:
            continue
        base = name == "machin_gd"
        tag = labels[name]
        ratios = st["ratio"] or [math.nan]
        report.row("mean cost/opt (feasible ones)", tag, statistics.mean(ratios), "x", baseline=base)
        report.row("p90 cost/opt", tag, _q(ratios, 0.9), "x", baseline=base)
        report.row("max cost/opt", tag, max(ratios), "x", baseline=base)
        report.row(
            "fraction optimal (<= 1 + 1e-9)",
            tag,
            sum(r <= 1 + 1e-9 for r in ratios) / len(st["time"]),
            "",
            baseline=base,
            higher_is_better=True,
        )
        report.row("infeasible rate", tag, statistics.mean(st["infeasible"]), "", baseline=base)
        report.row("p50 runtime", tag, _q(st["time"], 0.5), "s", baseline=base)
        report.row("p95 runtime", tag, _q(st["time"], 0.95), "s", baseline=base)
    a = stats["auto"]
    report.note(
        f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (runtimes are noisy)"
    )
    report.note(
        f"{len(records)} instances; machin GD on the {len(stats['machin_gd']['time'])} with n <= {gd_max_n}"
    )
    report.note(
        "ratios are cost / stored optimum; 'incumbent' optima (HiGHS stopped at 20 s) can give ratios < 1"
    )
    report.target("infeasible placements (auto)", sum(a["infeasible"]), "<=", 0, unit="")
    report.target("mean cost/opt over the suite (auto)", statistics.mean(a["ratio"]), "<=", 1.02)
    report.target("max cost/opt for n <= 10 (auto)", max(a["small_ratio"]), "<=", 1.2)
    report.target("exact when m^n <= 1e6: max cost/opt", max(exact_ratios), "<=", 1.0 + 1e-9)
    report.target("p95 runtime of auto for n <= 16", _q(a["time16"], 0.95), "<=", 0.050, unit="s")
    report.target("determinism (same seed, same result)", 1.0 if deterministic else 0.0, ">=", 1.0, unit="")
    gd = stats["machin_gd"]["infeasible"]
    report.note(
        f"machin GD (peer) returned a placement over memory on {statistics.mean(gd):.1%} of its instances"
    )
    report.finish(args)


if __name__ == "__main__":
    main()
