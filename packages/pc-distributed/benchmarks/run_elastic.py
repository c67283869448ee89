"""Benchmark of ElasticDataParallel's steady-state step against torch's DDP and pc's DataParallel, in one run.

1. 2 CPU processes, an MLP, SGD with momentum: ms per step of torch DDP, pc's blocking DataParallel and
ElasticDataParallel with a constant membership (no failures), interleaved rounds (order reversed every other
round), medians; the ratio elastic/DDP is the median over the rounds of the ratio within each round, the
larger of the 2 ranks. Target: <= 1.1x DDP. An A/A control (a second DDP) gives the noise floor.
2. 3 CPU processes: recovery time (a member SIGKILLed inside a step, to the survivors' next committed step)
   and join time (a new process started, to its first committed step, importing torch included), with the
   member timeout given in the row; beside them, in the same run, the restart-everything path: 3 DDP workers
   under ``torchrun --max-restarts 1`` that checkpoint every few steps, one SIGKILLed inside a step, torchrun
   restarting all three, which load the checkpoint and train again (seconds from the kill to the first step
   completed after the restart, and the steps redone since the checkpoint).

Usage: ``python packages/pc-distributed/benchmarks/run_elastic.py [--quick] [--out PATH]``.
"""

from __future__ import annotations

import ast
import multiprocessing as mp
import os
import pathlib
import pickle
import signal
import statistics
import subprocess
import sys
import tempfile
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


# One DDP worker under torchrun: the fault member's model and batch, a checkpoint by rank 0 every ``every``
# steps (written aside, then renamed), resumed from on a restart; rank 2 of the first incarnation SIGKILLs
# itself inside step ``kill_at``.
_TORCHRUN_WORKER = """
import datetime, os, signal, sys, time
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

out, steps, kill_at, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
torch.set_num_threads(1)
# The agent's store under a prefix of this incarnation: keys of the killed one must not be read again.
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                      timeout=datetime.timedelta(seconds=60))
world = int(os.environ["WORLD_SIZE"])
scoped = dist.PrefixStore(f"attempt{restart}", store)
dist.init_process_group("gloo", store=scoped, rank=rank, world_size=world)
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
sgd = torch.optim.SGD(net.parameters(), lr=0.01)
ckpt, start = os.path.join(out, "ckpt.pt"), 0
if os.path.exists(ckpt):
    state = torch.load(ckpt)
    net.load_state_dict(state["model"])
    sgd.load_state_dict(state["opt"])
    start = state["step"]
model = DistributedDataParallel(net)
x = torch.randn(8, 32)
for step in range(start, steps):
    sgd.zero_grad()
    loss = model(x).pow(2).mean()
    if step == kill_at and rank == 2 and restart == 0:
        with open(os.path.join(out, "killed"), "w") as fh:
            fh.write(repr((time.time(), step)))
        os.kill(os.getpid(), signal.SIGKILL)
    loss.backward()
    sgd.step()
    if restart and step == start and rank == 0:
        with open(os.path.join(out, "resumed"), "w") as fh:
            fh.write(repr((time.time(), start)))
    if (step + 1) % every == 0 and rank == 0:
        torch.save({"model": net.state_dict(), "opt": sgd.state_dict(), "step": step + 1}, ckpt + ".new")
        os.replace(ckpt + ".new", ckpt)
dist.destroy_process_group()
"""


def torchrun_restart(steps: int, kill_at: int, every: int) -> tuple[float, int]:
    """Seconds from the SIGKILL to the first step after torchrun restarted every worker, and steps redone."""
    with tempfile.TemporaryDirectory() as out:
        script = pathlib.Path(out, "worker.py")
        script.write_text(_TORCHRUN_WORKER)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
               "--max-restarts", "1", "--monitor-interval", "0.1", str(script), out, str(steps),
               str(kill_at), str(every)]  # fmt: skip
        agent = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            log, _ = agent.communicate(timeout=300)
        finally:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait(30)
        if agent.returncode != 0:
            raise RuntimeError(f"torchrun exited with {agent.returncode}:\n{log.decode(errors='replace')}")
        killed_at, _ = ast.literal_eval(pathlib.Path(out, "killed").read_text())
        resumed_at, resumed_from = ast.literal_eval(pathlib.Path(out, "resumed").read_text())
    return resumed_at - killed_at, kill_at - resumed_from


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
        f"{blocking:.3f}x, A/A control {control:.3f}x (the noise floor). Besides the all-reduce of the flat "
        "gradients, an elastic step in steady state makes six store requests on each member (its ready key, "
        "the check and read of the next quorum decided with the last commit, its done key, the wait for the "
        "others' and the decision) and three more on the lowest member (deciding the next quorum); a "
        "commit's last member deletes an old attempt's keys on a thread of its own."
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
    every = 5
    failures = []
    for _ in range(3):  # torch's own restarted DDP workers sometimes abort in gloo (SIGABRT): try again
        try:
            restart_s, redone = torchrun_restart(steps, kill_at + 2, every)
            break
        except RuntimeError as exc:
            failures.append(str(exc).strip().splitlines()[-1][:200])
    else:
        raise RuntimeError(f"the torchrun restart baseline failed 3 times: {failures}")
    if failures:
        report.note(
            f"the torchrun restart baseline failed {len(failures)} time(s) before the run measured (a torch "
            f"DDP worker of the restarted incarnation aborting in gloo): {failures}"
        )
    report.row(
        case,
        f"torchrun --max-restarts: SIGKILL -> first step after all 3 restart from a checkpoint every {every}",
        restart_s,
        "s",
        baseline=True,
    )
    report.row(case, "torchrun --max-restarts: steps redone since the checkpoint", redone, "steps")
    ratio = (recovered - killed_at) / restart_s
    report.target("elastic recovery time vs torchrun restart from a checkpoint", ratio, "<=", 1.0)
    report.note(
        "recovery is bounded by the member timeout (the dead member's heartbeat must age before the next "
        "quorum leaves it out); join time is mostly starting Python and importing torch. The torchrun row: "
        "its agent polls every 0.1 s (--monitor-interval), stops the two live workers, starts three new "
        "processes, which import torch, rendezvous, load the checkpoint and redo the steps since it; the "
        "elastic members lose no step and keep their processes."
    )
    report.finish(args)


if __name__ == "__main__":
    main()
