"""The report's table and plots of the scaling curves (benchmarks/scaling/run.py), used by run_all.py.

A curve (one entry of ``curves`` in ``docs/assets/bench/cpu/scaling.json``) holds, per point ``x`` (processes
or simulated hosts), the best ``throughput`` with its ``min`` and ``max``, the weak-scaling ``efficiency``
(``throughput / (x * throughput at 1)``, ideal 1) and ``efficiency_cores`` (against ``min(x, cores)``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

__all__ = ["curve_plot_name", "curve_table", "plot_curve_figure", "plot_curves"]


def curve_plot_name(curve: dict[str, Any]) -> str:
    """The PNG's file name under ``docs/assets/bench/``: ``scaling-<what>-<axis>.png``."""
    what = re.sub(r"[^a-z0-9]+", "-", curve["what"].split("(")[0].lower()).strip("-")
    return f"scaling-{what}-{curve['axis']}.png"


def _f(value: float) -> str:
    return "n/a" if value != value else f"{value:.4g}"  # NaN: a point that failed


def curve_table(curves: list[dict[str, Any]]) -> list[str]:
    """Markdown rows: every point of every curve beside the ideal and its two efficiencies."""
    lines = [
        "| curve | N | throughput, best (min to max) | ideal (N x at 1) | efficiency vs ideal | "
        "efficiency vs cores | CPU cost at 1 / at N |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in curves:
        base = c["throughput"][0]
        for i, n in enumerate(c["x"]):
            measured = f"{_f(c['throughput'][i])} ({_f(c['min'][i])} to {_f(c['max'][i])}) {c['unit']}"
            lines.append(
                f"| {c['what']} over {c['axis']} | {n} | {measured} | {_f(n * base)} | "
                f"{_f(c['efficiency'][i])} | {_f(c['efficiency_cores'][i])} (min({n}, {c['cores']}) cores) | "
                f"{_f(c.get('efficiency_cpu', [float('nan')] * len(c['x']))[i])} |"
            )
    return lines


def plot_curve_figure(curve: dict[str, Any], title: str) -> Any:
    """Two panels: throughput against N beside the ideal lines, and the two efficiencies beside 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, ys = curve["x"], curve["throughput"]
    base, cores = ys[0], curve["cores"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    err = [[y - lo for y, lo in zip(ys, curve["min"], strict=True)]]
    err.append([hi - y for y, hi in zip(ys, curve["max"], strict=True)])
    label = "measured (best of the repetitions, min to max)"
    left.errorbar(xs, ys, yerr=err, marker="o", capsize=4, label=label)
    left.plot(xs, [n * base for n in xs], "k--", linewidth=0.9, label="ideal: N x throughput at 1")
    left.plot(
        xs,
        [min(n, cores) * base for n in xs],
        ":",
        color="gray",
        linewidth=1.2,
        label=f"ideal on {cores} cores: min(N, {cores}) x at 1",
    )
    left.set_xticks(xs)
    left.set_xlabel(curve["axis"])
    left.set_ylabel(f"{curve['unit']} (higher is better)")
    left.set_ylim(bottom=0)
    left.legend(fontsize=7)
    right.plot(xs, curve["efficiency"], marker="o", label="efficiency vs ideal")
    right.plot(xs, curve["efficiency_cores"], marker="s", label=f"efficiency vs the {cores} cores")
    if curve.get("efficiency_cpu"):
        right.plot(xs, curve["efficiency_cpu"], marker="^", label="CPU cost per unit at 1 / at N")
    right.axhline(1.0, color="black", linewidth=0.8, label="ideal (= 1)")
    right.set_xticks(xs)
    right.set_xlabel(curve["axis"])
    right.set_ylabel("weak-scaling efficiency")
    right.set_ylim(bottom=0)
    right.legend(fontsize=7)
    fig.suptitle(f"{curve['name']}\n{title}", fontsize=9)
    fig.tight_layout()
    return fig


def plot_curves(result: dict[str, Any], title: str, folder: Path) -> list[Path]:
    """Write one PNG per curve of ``result`` into ``folder``; return their paths."""
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for curve in result.get("curves", []):
        fig = plot_curve_figure(curve, title)
        path = folder / curve_plot_name(curve)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
