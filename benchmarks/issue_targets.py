"""Issue 20's performance targets: each beside the value its package's benchmark measured, and the verdict.

``run_all.py`` writes the table these rows make at the top of the report; a target that no benchmark measures
is listed as not measured, never dropped.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["ISSUE", "ISSUE_TARGETS", "IssueTarget", "cell", "fmt", "issue_rows", "verdict"]


class IssueTarget(NamedTuple):
    """A target of the performance issue, found in a package's results by the name of its measured target.

    The package's benchmark states the measurement with :meth:`benchlib.Report.target` under ``measured_as``;
    the verdict here uses the issue's bound, and the reason for a miss is that target's ``note``.
    """

    package: str
    text: str
    measured_as: str
    op: str
    bound: float | None  # None: the target is a curve, reported rather than bounded
    unit: str = "x"


ISSUE = "issue 20"
# Issue 20 ("Performance to the limit"): every target, in the issue's words, with the name of the package
# target that measures it. A target no benchmark measures yet is reported as not measured, never left out.
ISSUE_TARGETS: tuple[IssueTarget, ...] = (
    IssueTarget(
        "pc-pickle",
        "100 MB tensor dumps+loads vs pickle-5",
        "100 MB tensor dumps+loads vs pickle5",
        "<=",
        0.25,
    ),
    IssueTarget("pc-pickle", "10k small objects vs pickle-5", "10k small objects vs pickle5", "<=", 1.1),
    IssueTarget(
        "pc-pickle",
        "peak memory of dumps+loads of a 100 MB tensor / the tensor",
        "peak RSS of dumps+loads, 100 MB tensor / tensor",
        "<=",
        2.1,
    ),
    IssueTarget(
        "pc-pool",
        "chunksize-1 throughput vs mp.Pool (fork)",
        "chunksize-1 throughput vs mp.Pool(fork)",
        ">=",
        1.0,
    ),
    IssueTarget("pc-pool", "200 sequential apply vs mp.Pool", "200 sequential applies vs mp.Pool", "<=", 1.0),
    *(
        IssueTarget(
            "pc-sync",
            f"SyncBN / plain BN, same {n} CPU thread replicas, {shape}",
            f"(issue) SyncBN / plain BN, same {n} replicas, {shape}",
            "<=",
            1.3,
        )
        for shape in ("32x64x28x28", "64x256x14x14")
        for n in (2, 4)
    ),
    IssueTarget(
        "pc-sync",
        "(issue 30) CPU DDP step (gloo, 2 ranks), process-group SyncBatchNorm / plain BN",
        "(issue 30) CPU DDP step, SyncBatchNorm / plain BN, 2 ranks",
        "<=",
        1.3,
    ),
    *(
        IssueTarget(
            "pc-sync",
            f"non-parallel step vs plain BN, {shape}",
            f"(design) non-parallel train step vs BN, {shape}",
            "<=",
            1.05,
        )
        for shape in ("32x64x28x28", "64x256x14x14")
    ),
    # Issue 45 ("On the GPU, as fast as the hardware allows"): the launch budget of the fused CUDA path,
    # counted on CPU through the kernels' stand-ins (packages/pc-sync/benchmarks/op_count.py).
    IssueTarget(
        "pc-sync",
        "(issue 45) ops one synchronized layer issues per replica per training step on the fused CUDA path "
        "(about 10; the composite path: about 38 more than plain batch norm)",
        "(issue 45) fused path: ops per replica per training step, 2 replicas",
        "<=",
        10.0,
        "ops",
    ),
    IssueTarget(
        "pc-replicate",
        "fixed cost per forward, 4 CPU replicas (the persistent replica threads; the design's 1 ms)",
        "fixed overhead per forward, n=4 (ms)",
        "<=",
        1.0,
        "ms",
    ),
    IssueTarget(
        "pc-distributed",
        "blocking DataParallel step vs DDP, 2.1M-parameter MLP",
        "blocking DP step time vs DDP",
        "<=",
        1.0,
    ),
    IssueTarget(
        "pc-distributed", "registered_sync vs a raw rpc_sync", "registered_sync vs raw rpc_sync", "<=", 1.05
    ),
    # Issue 32 ("RPC groups on torch.distributed's process groups"): the c10d RPC backend against TensorPipe
    # and against raw gloo point-to-point ops (packages/pc-distributed/benchmarks/run_rpc_backends.py), and
    # the gradient server on both backends (packages/pc-server/benchmarks/run_backends.py).
    IssueTarget(
        "pc-distributed",
        "(issue 32) small registered_sync on the c10d backend / on TensorPipe TCP-only",
        "(issue 32) c10d small call / TensorPipe TCP-only",
        "<=",
        1.0,
    ),
    IssueTarget(
        "pc-distributed",
        "(issue 32) 4 MB tensor registered_sync on the c10d backend: bandwidth / raw gloo send+recv",
        "(issue 32) c10d 4 MB bandwidth / raw send+recv",
        ">=",
        0.8,
    ),
    IssueTarget(
        "pc-server",
        "(issue 32) gradient server scaling, 1, 2, 4 clients: on c10d no worse than on TensorPipe TCP-only",
        "(issue 32) grad server scaling on c10d vs TensorPipe TCP-only",
        ">=",
        1.0,
    ),
    IssueTarget(
        "pc-assigner", "mean cost / proven optimum", "mean cost / proven optimum (auto)", "<=", 1.001
    ),
    IssueTarget(
        "pc-assigner", "p95 runtime for n <= 16 (< 20 ms)", "p95 runtime of auto for n <= 16", "<=", 0.02, "s"
    ),
    IssueTarget(
        "pc-assigner", "n = 200 modules: runtime (< 1 s)", "n = 200: runtime of auto", "<=", 1.0, "s"
    ),
    IssueTarget(
        "pc-assigner", "n = 200 modules: cost / LP lower bound", "n = 200: cost / LP lower bound", "<=", 1.05
    ),
    *(
        IssueTarget(
            "scaling",
            f"{what} against {axis}: weak-scaling efficiency reported beside the ideal",
            f"{what} scaling over {axis}",
            ">=",
            None,
        )
        for what in ("gradient server (pushes/s)", "DataParallel (samples/s)")
        for axis in ("processes (1, 2, 4)", "hosts (1, 2, 3)")
    ),
)


def fmt(value: float) -> str:
    return f"{value:.5g}"


def verdict(met: bool, note: str, missing: str = "") -> str:
    """``yes``, or ``**no**`` with the reason the benchmark gave (``missing`` when it gave none)."""
    if met:
        return "yes"
    why = note or missing
    return f"**no**: {why}" if why else "**no**"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def issue_rows(results: list[dict[str, Any]]) -> list[str]:
    """The issue's targets as table rows: each beside its measured value and a verdict."""
    by_package = {r["package"]: r for r in results}
    lines = []
    for it in ISSUE_TARGETS:
        bound = "a curve" if it.bound is None else f"{it.op} {it.bound:.5g}{it.unit}"
        res = by_package.get(it.package)
        found = [t for t in (res or {}).get("targets", []) if t["name"] == it.measured_as]
        if not found:
            why = (
                "no benchmark measures it yet"
                if res is None or it.package == "scaling"
                else (f"the package's benchmark reports no target named '{it.measured_as}'")
            )
            lines.append(f"| {it.package} | {cell(it.text)} | not measured | {bound} | **no**: {why} |")
            continue
        t = found[-1]
        measured = float(t["measured"])
        if it.bound is None:
            met = bool(t["met"])
        else:
            met = measured <= it.bound if it.op == "<=" else measured >= it.bound
        # a target measured apart from its package's stored run (merged into it) carries its own time
        run_at = t.get("run_at") or (res or {}).get("run_at")
        when = f" (run {run_at})" if run_at else ""
        lines.append(
            f"| {it.package} | {cell(it.text)} | {measured:.5g}{t['unit']}{when} | {bound} | "
            f"{cell(verdict(met, t.get('note', ''), 'the benchmark records no reason'))} |"
        )
    return lines
