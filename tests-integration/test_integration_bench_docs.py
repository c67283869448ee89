"""Benchmark numbers in the docs are generated, never typed; the plots read one way and name their run.

The guides include ``docs/bench-tables/<package>.md``, cut from the generated report by benchmarks/run_all.py,
so a guide and the report cannot disagree; a guide's Performance section types no measurement of its own.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_ALL = ROOT / "benchmarks" / "run_all.py"
# A number with the unit of a measurement: a ratio (x or the multiplication sign), a time, a rate, a size.
MEASUREMENT = re.compile("\\d[\\d.,]*\\s*(?:\u00d7|" r"x\b|%|s\b|ms\b|µs\b|us\b|/s\b|M\b|B\b|bytes\b)")


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


def test_bench_fragments_are_cut_from_the_committed_report() -> None:
    run_all = _run_all()
    expected = run_all.fragments_from_report((ROOT / "docs" / "benchmarks-report.md").read_text())
    committed = {p.stem: p.read_text() for p in sorted((ROOT / "docs" / "bench-tables").glob("*.md"))}
    gpu = committed.pop("gpu")  # made from the GPU runs' JSON, not from the report (below)
    assert "| pc-sync | (cuda) " in gpu
    assert sorted(committed) == sorted(expected)
    for package, text in expected.items():
        assert committed[package] == text, (
            f"docs/bench-tables/{package}.md differs: run benchmarks/run_all.py"
        )


def test_bench_fragment_holds_the_package_targets_and_table() -> None:
    report = "### Targets\n\n| package | target |\n| --- | --- |\n| pc-a | speed | 2x | <= 3x | yes |\n"
    report += "| pc-b | size | 1B | <= 2B | yes |\n\n### pc-a\n\nrun today\n\n| case | impl |\n- a note\n"
    fragments = _run_all().fragments_from_report(report)
    assert list(fragments) == ["pc-a"]
    assert fragments["pc-a"].splitlines() == [
        _run_all().FRAGMENT_HEADER,
        "",
        "| target | measured | bound | met |",
        "| --- | --- | --- | --- |",
        "| speed | 2x | <= 3x | yes |",  # pc-a's target only, without the package column
        "",
        "run today",
        "",
        "| case | impl |",
        "- a note",
    ]


def _performance_sections(text: str) -> list[str]:
    return re.findall(r"^#{2,3} Performance\n(.*?)(?=^#{1,3} |\Z)", text, flags=re.S | re.M)


def test_bench_guides_type_no_measurement_in_their_performance_sections() -> None:
    guides = [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "benchmarks-report.md"]
    offenders = []
    for guide in guides:
        for section in _performance_sections(guide.read_text()):
            for line in section.splitlines():
                if line.startswith("--8<--"):
                    continue
                prose = re.sub(r"`[^`]*`|\]\([^)]*\)", "", line)  # code and link targets are not measurements
                offenders += [f"{guide.name}: {line.strip()}" for _ in MEASUREMENT.findall(prose)[:1]]
    assert not offenders, "include docs/bench-tables/<package>.md instead of typing numbers:\n" + "\n".join(
        offenders
    )
    assert MEASUREMENT.search("a 100 MB tensor about 0.5x, 7 M tasks/s")  # what the check looks for
    assert not MEASUREMENT.search("on 2 processes, 10,000 tasks")


def test_bench_gpu_table_is_generated_from_the_committed_gpu_json(tmp_path: Path) -> None:
    run_all = _run_all()
    committed = (ROOT / "docs" / "bench-tables" / "gpu.md").read_text()
    run_all.FRAGMENTS = tmp_path  # write the fresh table here, not over the committed one
    run_all.write_gpu_fragment()
    assert (tmp_path / "gpu.md").read_text() == committed, "docs/bench-tables/gpu.md differs: run run_all.py"
    assert "![" not in committed  # the CPU plots do not belong to the GPU rows


def test_bench_issue_targets_each_stand_beside_a_verdict() -> None:
    run_all = _run_all()
    first, second = [t for t in run_all.ISSUE_TARGETS if t.package == "pc-pickle"][:2]
    result = {
        "package": "pc-pickle",
        "run_at": "today",
        "targets": [
            {"name": first.measured_as, "measured": first.bound / 2, "unit": "x", "met": True, "note": ""},
            {"name": second.measured_as, "measured": second.bound * 2, "unit": "x", "met": False,
             "note": "memcpy-bound"},
        ],
    }  # fmt: skip
    result["targets"][0]["run_at"] = "yesterday"  # measured apart and merged into the package's run
    rows = run_all.issue_rows([result])
    assert len(rows) == len(run_all.ISSUE_TARGETS)  # every target is listed, measured or not
    by_text = {row.split(" | ")[1]: row for row in rows}
    assert by_text[first.text].endswith("| yes |")
    assert "(run yesterday)" in by_text[first.text]
    assert f"{second.bound * 2:.5g}x (run today)" in by_text[second.text]
    assert by_text[second.text].endswith("| **no**: memcpy-bound |")
    unmeasured = next(t for t in run_all.ISSUE_TARGETS if t.package == "pc-pool")
    assert "| not measured |" in by_text[unmeasured.text]
    assert by_text[unmeasured.text].endswith("no benchmark measures it yet |")


def _scaling_run() -> Any:
    spec = importlib.util.spec_from_file_location(
        "bench_scaling_run", ROOT / "benchmarks" / "scaling" / "run.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _job(gs: list[float], dp: list[float], gs_cpu: list[float]) -> dict[str, Any]:
    # 2 s of pushes over 2 repetitions; rank 0 used 1.5 CPU seconds
    return {"gs": gs, "dp": dp, "gs_cpu": gs_cpu, "push_s": [1.0, 1.0], "push_cpu_s": [1.0, 0.5]}


def test_bench_scaling_job_splits_into_points_with_their_throughputs() -> None:
    result = {
        "pushes_per_client": 10,
        "batch": 64,
        "dp_steps": 5,
        "samples": {
            "1": [{"push_s": 0.5, "push_returned_s": 0.25, "dp_s": 1.0, "push_cpu_s": 0.4}],
            "2": [
                {"push_s": 1.0, "push_returned_s": 0.5, "dp_s": 2.0, "push_cpu_s": 0.6, "all_push_cpu_s": 1.0}
            ],
        },
        "counters": {"1": {"applied": 11.0, "dropped": 0.0}, "2": {"applied": 20.0, "dropped": 2.0}},
    }
    points = _scaling_run().split(result, 3.5)
    assert sorted(points) == [1, 2]
    assert points[1]["gs"] == [20.0]  # 1 client x 10 pushes in 0.5 s, applied
    assert points[2]["gs"] == [20.0]  # 2 clients x 10 pushes in 1 s
    assert points[2]["gs_returned"] == [40.0]
    assert points[2]["dp"] == [2 * 64 * 5 / 2.0]  # samples of every process together
    assert (points[2]["dropped"], points[2]["load"]) == (2.0, 3.5)
    assert points[2]["gs_cpu"] == [1.0 / 20]  # CPU seconds of both ranks per push


def test_bench_scaling_curve_reports_efficiency_beside_the_ideal_and_the_cores() -> None:
    run = _scaling_run()
    samples = {
        ("processes", 1): [_job([90.0, 100.0, 110.0], [10.0], [0.02, 0.01, 0.03])],
        ("processes", 2): [_job([150.0], [20.0], [0.02])],
        ("processes", 4): [_job([200.0], [20.0], [0.04, 0.05])],
    }
    c = run.curve("gs", "processes", (1, 2, 4), samples, 2, "")
    assert c["name"] in {t.measured_as for t in _run_all().ISSUE_TARGETS if t.package == "scaling"}
    assert c["complete"]
    assert c["throughput"] == [110.0, 150.0, 200.0]  # the best of the repetitions
    assert (c["min"][0], c["max"][0]) == (90.0, 110.0)
    assert c["efficiency"] == [1.0, 150 / 220, 200 / 440]  # throughput / (N x throughput at 1)
    assert c["efficiency_cores"] == [1.0, 150 / 220, 200 / 220]  # ... / (min(N, 2 cores) x throughput at 1)
    assert c["efficiency_cpu"] == [1.0, 0.5, 0.25]  # CPU seconds per push at 1 / at N, the cheapest
    assert c["cpu_per_wall"][2] == 0.75  # rank 0's (the primary's) CPU seconds per wall second of the pushes
    del samples[("processes", 4)]  # a failed point: the curve is not complete, so its target is not met
    assert not run.curve("gs", "processes", (1, 2, 4), samples, 2, "")["complete"]
    assert run.curve("gs", "hosts", (1, 2, 3), {}, 2, "no root")["why_not"] == "no root"


SCALING = {
    "package": "scaling",
    "run_at": "today",
    "rows": [],
    "notes": [],
    "errors": [],
    "targets": [
        {"name": "DataParallel (samples/s) scaling over hosts (1, 2, 3)", "measured": 0.5, "op": ">=",
         "bound": 0.0, "unit": "", "met": True, "note": "", "curve": True},
    ],
    "curves": [
        {"name": "DataParallel (samples/s) scaling over hosts (1, 2, 3)", "what": "DataParallel (samples/s)",
         "axis": "hosts", "unit": "samples/s", "x": [1, 2, 3], "throughput": [10.0, 12.0, 15.0],
         "min": [9.0, 11.0, 14.0], "max": [11.0, 13.0, 16.0], "efficiency": [1.0, 0.6, 0.5],
         "efficiency_cores": [1.0, 0.6, 0.75], "cores": 2, "complete": True, "why_not": ""},
    ],
}  # fmt: skip


def test_bench_scaling_entry_is_reported_as_curves_with_a_plot_each(tmp_path: Path) -> None:
    run_all = _run_all()
    assert "scaling" in run_all._packages()
    assert (run_all._bench_dir("scaling") / "run.py").exists()
    rows = run_all.issue_rows([SCALING])
    by_text = {row.split(" | ")[1]: row for row in rows}
    hosts = next(t for t in run_all.ISSUE_TARGETS if t.measured_as == SCALING["targets"][0]["name"])
    assert "| 0.5 (run today) | a curve | yes |" in by_text[hosts.text]
    others = [t for t in run_all.ISSUE_TARGETS if t.package == "scaling" and t is not hosts]
    assert len(others) == 3
    assert all("| not measured |" in by_text[t.text] for t in others)
    report = run_all.markdown([SCALING], plots=False)
    assert (
        "| scaling | DataParallel (samples/s) scaling over hosts (1, 2, 3) | 0.5 | a curve | yes |" in report
    )
    # every point beside the ideal (N x the throughput at 1) and both efficiencies
    assert "| DataParallel (samples/s) over hosts | 3 | 15 (14 to 16) samples/s | 30 | 0.5 | 0.75 " in report
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    (png,) = run_all.plot_curves(SCALING, "today", tmp_path)
    assert png.name == "scaling-dataparallel-hosts.png"
    import scaling_plots  # on sys.path once run_all.py is loaded

    fig = scaling_plots.plot_curve_figure(SCALING["curves"][0], "today")
    try:
        left, right = fig.axes
        labels = [t.get_text() for t in left.get_legend().get_texts()]
        assert sorted(labels) == [
            "ideal on 2 cores: min(N, 2) x at 1",
            "ideal: N x throughput at 1",
            "measured (best of the repetitions, min to max)",
        ]
        assert "ideal (= 1)" in [t.get_text() for t in right.get_legend().get_texts()]
    finally:
        plt.close(fig)


def test_bench_committed_scaling_results_hold_every_curve_and_its_plot() -> None:
    stored = ROOT / "docs" / "assets" / "bench" / "cpu" / "scaling.json"
    if not stored.exists():
        pytest.skip("no scaling run committed yet")
    run_all = _run_all()
    result = json.loads(stored.read_text())
    names = [c["name"] for c in result["curves"]]
    assert names == [t.measured_as for t in run_all.ISSUE_TARGETS if t.package == "scaling"]
    for c in result["curves"]:
        assert c["x"] == ([1, 2, 4] if c["axis"] == "processes" else [1, 2, 3])
        assert (ROOT / "docs" / "assets" / "bench" / run_all.curve_plot_name(c)).exists()
    assert sorted(t["name"] for t in result["targets"]) == sorted(names)


def test_bench_gpu_table_says_not_measured_without_gpu_json(tmp_path: Path) -> None:
    run_all = _run_all()
    run_all.FRAGMENTS = tmp_path / "tables"
    run_all.GPU_RESULTS = tmp_path / "none"
    run_all.write_gpu_fragment()
    text = (tmp_path / "tables" / "gpu.md").read_text()
    assert "Not yet measured on a GPU" in text
    assert "|" not in text  # no table, no number


def test_bench_gpu_report_keeps_measured_runs_and_leaves_out_a_run_without_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _run_all()
    import gpu_report  # benchmarks/ is on sys.path once run_all is loaded

    check = tmp_path / "bench"
    check.mkdir()
    (check / "pc-pool-cuda.json").write_text(
        json.dumps({"package": "pc-pool", "rows": [], "targets": [], "notes": ["no CUDA device"]})
    )
    measured = {
        "package": "pc-sync",
        "environment": {"gpu": "Some GPU", "torch": "2.11", "python": "3.12", "cpus": 16},
        "rows": [
            {
                "case": "(cuda) step",
                "impl": "SyncBN2d",
                "value": 0.002,
                "unit": "s",
                "baseline": False,
                "ratio": 1.02,
                "higher_is_better": False,
            }
        ],
        "targets": [
            {
                "name": "(cuda) step vs BN",
                "measured": 1.02,
                "op": "<=",
                "bound": 1.05,
                "unit": "x",
                "met": True,
                "note": "",
            }
        ],
        "notes": [],
    }
    (check / "pc-sync-cuda.json").write_text(json.dumps(measured))
    monkeypatch.setattr(gpu_report.run_all, "GPU_RESULTS", tmp_path / "kept")
    assert gpu_report.main(["--from", str(check), "--md", str(tmp_path / "gpu.md")]) == 0
    kept = sorted(p.name for p in (tmp_path / "kept").iterdir())
    assert kept == ["pc-sync-cuda.json"]
    assert "Some GPU, tools/gpu_check.sh" in json.loads((tmp_path / "kept" / kept[0]).read_text())["run_at"]
    text = (tmp_path / "gpu.md").read_text()
    assert "| pc-sync | (cuda) step vs BN | 1.02x | <= 1.05x | yes |" in text
    assert "pc-pool" not in text


def test_bench_gpu_report_merges_the_cuda_files_of_one_package(tmp_path: Path) -> None:
    _run_all()
    import gpu_report

    def run(impl: str, target: str, note: str) -> dict[str, Any]:
        row = {"case": "(cuda) c", "impl": impl, "value": 0.001, "unit": "s", "baseline": False}
        row.update(ratio=None, higher_is_better=False)
        goal = {"name": target, "measured": 1.0, "op": "<=", "bound": 1.1, "unit": "x", "met": True}
        goal["note"] = ""
        return {"package": "pc-sync", "rows": [row], "targets": [goal], "notes": [note]}

    check = tmp_path / "bench"
    check.mkdir()
    (check / "pc-sync-processes-cuda.json").write_text(json.dumps(run("pc DDP", "DDP vs torch", "b")))
    (check / "pc-sync-cuda.json").write_text(json.dumps(run("SyncBN2d", "step vs BN", "a")))
    (merged,) = gpu_report.load_runs(check)  # one run per package, the files in name order
    assert [r["impl"] for r in merged["rows"]] == ["SyncBN2d", "pc DDP"]
    assert [t["name"] for t in merged["targets"]] == ["step vs BN", "DDP vs torch"]
    assert merged["notes"] == ["a", "b"]
    assert gpu_report.gpu_markdown([merged]).count("### pc-sync") == 1
