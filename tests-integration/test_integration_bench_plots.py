"""The benchmark plots read one way (lower is better), carry a legend and name the run's date and machine."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

RUN_ALL = Path(__file__).resolve().parents[1] / "benchmarks" / "run_all.py"


def _run_all() -> Any:
    spec = importlib.util.spec_from_file_location("bench_run_all", RUN_ALL)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RESULT = {
    "package": "pc-demo",
    "run_at": "2026-11-21 22:06 UTC",
    "quick": False,
    "environment": {"cpus": 2, "platform": "Linux-x86_64", "torch": "2.13.0+cpu", "python": "3.11.7"},
    "rows": [
        {"case": "t", "impl": "peer", "value": 1.0, "unit": "s", "baseline": True, "ratio": None},
        {"case": "t", "impl": "ours", "value": 0.5, "unit": "s", "baseline": False, "ratio": 0.5},
        {"case": "r", "impl": "peer", "value": 100.0, "unit": "/s", "baseline": True, "ratio": None},
        {"case": "r", "impl": "ours", "value": 400.0, "unit": "/s", "baseline": False, "ratio": 4.0,
         "higher_is_better": True},
    ],
}  # fmt: skip


def test_bench_plot_ratios_all_read_lower_is_better() -> None:
    run_all = _run_all()
    time_row, rate_row = RESULT["rows"][1], RESULT["rows"][3]
    assert run_all.cost_ratio(time_row) == 0.5
    assert run_all.cost_ratio(rate_row) == 0.25  # 4x the throughput costs a quarter


def test_bench_plot_title_names_date_and_machine() -> None:
    title = _run_all().plot_title(RESULT)
    for part in ("pc-demo", "2026-11-21 22:06 UTC", "2 CPUs", "Linux-x86_64", "torch 2.13.0+cpu"):
        assert part in title


def test_bench_plot_has_a_legend_and_one_direction() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    fig = _run_all().plot_figure(RESULT)
    try:
        (ax,) = fig.axes
        legend = ax.get_legend()
        assert legend is not None
        assert [t.get_text() for t in legend.get_texts()] == [
            "better than the baseline (< 1)",
            "worse than the baseline (> 1)",
            "the baseline (= 1)",
        ]
        assert "lower is better" in ax.get_xlabel()
        assert [round(p.get_width(), 6) for p in ax.patches] == [0.5, 0.25]
        assert [t.get_text() for t in ax.get_yticklabels()] == ["t — ours", "r — ours (1 / throughput)"]
    finally:
        plt.close(fig)
