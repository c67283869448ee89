"""Benchmark of ElasticDataParallel's steady-state step against torch's DDP and pc's DataParallel, in one run.

1. 2 CPU processes, an MLP, SGD with momentum: ms per step of torch DDP, pc's blocking DataParallel and
ElasticDataParallel with a constant membership (no failures), interleaved rounds (order reversed every other
round), medians; the ratio elastic/DDP is the median over the rounds of the ratio within each round, the
larger of the 2 ranks. Target: <= 1.1x DDP. An A/A control (a second DDP) gives the noise floor.
2. 3 CPU processes: recovery time (a member SIGKILLed inside a step, to the survivors' next committed step)
   and join time (a new process started, to its first committed step, importing torch included), with the
   member timeout given in the row. No comparison with torchrun's restart-from-checkpoint path is made here.

Usage: ``python packages/pc-distributed/benchmarks/run_elastic.py [--quick] [--out PATH]``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pathlib
import pickle
import signal
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))

import torch
import torch.distributed as dist
from benchlib import Report, bench_args
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pc_distributed import (
    DataParallel,
    DataParallelOptimizer,
    ElasticDataParallel,
    RankDiedError,
    StepContext,
    run_world,
)

MODES = ["ddp", "blocking", "elastic", "ddp (A/A control)"]


def mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width // 2, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width // 2))  # fmt: skip


def step_worker(rank: int, width: int, steps: int, rounds: int, batch: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(batch, width // 2, generator=g), torch.randn(batch, width // 2, generator=g))
            for _ in range(steps)]  # fmt: skip

    def run(mode: str, r: int) -> float:
        net = mlp(width)
        sgd = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        times = []
        if mode == "elastic":
            edp = ElasticDataParallel(net, sgd, name=str(rank), job=f"bench{r}", initial_members=2)
            it = iter(data)

            def compute(ctx: StepContext) -> None:
                x, y = next(it)
                ((net(x) - y) ** 2).mean().backward()

            with edp:
                for _ in range(steps):
                    start = time.perf_counter()
                    edp.train_step(compute)
                    times.append(time.perf_counter() - start)
            dist.barrier()
            return statistics.median(times[1:])
        if mode == "blocking":
            opt: Any = DataParallelOptimizer(sgd)
            model: nn.Module = DataParallel(net, optimizer=opt, blocking_parameter_updates=True)
        else:
            opt, model = sgd, DistributedDataParallel(net)
        dist.barrier()
        for x, y in data:
            start = time.perf_counter()
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            times.append(time.perf_counter() - start)
        dist.barrier()
        return statistics.median(times[1:])

    samples: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(rounds):
        for m in MODES if r % 2 == 0 else MODES[::-1]:
            samples[m].append(run(m, r))
    return {
        "ms": {m: statistics.median(v) * 1e3 for m, v in samples.items()},
        "elastic_ratios": [e / d for e, d in zip(samples["elastic"], samples["ddp"], strict=True)],
        "blocking_ratios": [b / d for b, d in zip(samples["blocking"], samples["ddp"], strict=True)],
        "control_ratios": [c / d for c, d in zip(samples["ddp (A/A control)"], samples["ddp"], strict=True)],
        "params": sum(p.numel() for p in mlp(width).parameters()),
    }


FAULTS = {"heartbeat_period": 0.2, "member_timeout": 2.0, "collective_timeout": 10.0}


def _fault_member(name: str, steps: int, kill_at: int, join_at: int, conn: Any = None) -> dict[str, Any]:
    torch.set_num_threads(1)
    net = mlp(64)
    sgd = torch.optim.SGD(net.parameters(), lr=0.01)
    commits: list[float] = []
    joiner: Any = None
    reader: Any = None
    x = torch.randn(8, 32)

    def compute(ctx: StepContext) -> None:
        nonlocal joiner, reader
        if ctx.step == kill_at and name == "2":
            edp._stores.store.set("killed_at", repr(time.time()))  # the job's store (outlives this process)
            os.kill(os.getpid(), signal.SIGKILL)
        if ctx.step == join_at and name == "0" and joiner is None:
            spawn = mp.get_context("spawn")
            reader, writer = spawn.Pipe(duplex=False)
            joiner = spawn.Process(target=_joiner, args=(time.time(), steps, writer))
            joiner.start()
            writer.close()
        if ctx.step == join_at + 1 and name == "0":
            # Hold this step until the new process is at a boundary (enlisted as the 4th registration), so
            # that it joins before the job ends however long its start takes.
            edp._stores.waits.wait(["reg/3"], 120.0)
        net(x).pow(2).mean().backward()

    edp = ElasticDataParallel(net, sgd, name=name, job="faults", initial_members=3 if conn is None else 1,
                              **FAULTS)  # fmt: skip
    with edp:
        while edp.step < steps:
            edp.train_step(compute)
            commits.append(time.time())
        out: dict[str, Any] = {"commits": commits, "log": list(edp.quorum_log)}
        if conn is None and name == "0":
            out["killed_at"] = float(edp._stores.store.get("killed_at").decode())
    if joiner is not None:
        if reader.poll(120):
            out["joiner"] = pickle.loads(reader.recv_bytes())
        joiner.join(30)
    return out


def _joiner(started: float, steps: int, conn: Any) -> None:
    try:
        out = _fault_member("new", steps, -1, -1, conn)
        out["started"] = started
        conn.send_bytes(pickle.dumps(out))
    finally:
        conn.close()


def fault_worker(rank: int, steps: int, kill_at: int, join_at: int) -> dict[str, Any]:
    return _fault_member(str(rank), steps, kill_at, join_at)


def main() -> None:
    args = bench_args("pc-distributed (elastic data parallel)")
    report = Report("pc-distributed-elastic")
    width, steps, rounds = (512, 8, 3) if args.quick else (1024, 20, 6)
    both = run_world(step_worker, 2, args=(width, steps, rounds, 64), init_rpc=False, timeout=600)
    ms = both[0]["ms"]
    case = f"MLP {both[0]['params'] / 1e6:.2f}M params, 2 procs, ms/step"
    report.row(case, "torch DDP", ms["ddp"], "ms", baseline=True)
    report.row(case, "pc DataParallel blocking", ms["blocking"], "ms")
    report.row(case, "pc ElasticDataParallel", ms["elastic"], "ms")
    report.row(case, "a second torch DDP (A/A control)", ms["ddp (A/A control)"], "ms")
    elastic = max(statistics.median(r["elastic_ratios"]) for r in both)
    blocking = max(statistics.median(r["blocking_ratios"]) for r in both)
    control = max(statistics.median(r["control_ratios"]) for r in both)
    report.target("elastic DP steady-state step time vs DDP", elastic, "<=", 1.1)
    report.note(
        f"ratios: median over {rounds} rounds of the ratio within each round, the larger of the 2 ranks: "
        f"elastic/DDP {elastic:.3f}x, elastic/DataParallel {elastic / blocking:.3f}x, DataParallel/DDP "
        f"{blocking:.3f}x, A/A control {control:.3f}x (the noise floor). Elastic steps make about a dozen "
        "store round trips each (quorum and commit decision) besides the all-reduce of the flat gradients."
    )
    steps, kill_at, join_at = (30, 5, 10) if args.quick else (60, 10, 20)
    try:
        run_world(fault_worker, 3, args=(steps, kill_at, join_at), init_dist=False, init_rpc=False,
                  timeout=300, grace_period=280)  # fmt: skip
        raise RuntimeError("the member meant to be killed was not")
    except RankDiedError as exc:
        survivors = exc.run_world_results  # type: ignore[attr-defined]
    first = survivors[0]
    killed_at = first["killed_at"]
    recovered = min(t for t in first["commits"] if t > killed_at)
    case = f"3 procs, member_timeout {FAULTS['member_timeout']:g} s, seconds"
    report.row(case, "recovery: SIGKILL inside a step -> next committed step", recovered - killed_at, "s")
    joined = first.get("joiner")
    if joined is not None and joined["commits"]:
        report.row(case, "join: new process started -> its first committed step", joined["commits"][0] -
                   joined["started"], "s")  # fmt: skip
    else:
        report.note("the joining process reported no committed step")
    report.note(
        "recovery is bounded by the member timeout (the dead member's heartbeat must age before the next "
        "quorum leaves it out); join time is mostly starting Python and importing torch. torchrun's restart "
        "of every worker from a checkpoint was measured separately (docs/multihost.md: training again "
        "14-26 s after the kill on simulated hosts), not side by side in this run."
    )
    report.finish(args)


if __name__ == "__main__":
    main()
