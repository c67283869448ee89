"""Benchmarks of pc_distributed's data parallelism against torch's DistributedDataParallel, in one run.

1. 2 CPU processes, an MLP of ~2M parameters: ms per step of DDP, heat-style blocking and non-blocking
   DataParallel and a no-communication baseline (interleaved rounds, medians), plus each mode's deviation from
   single-process full-batch SGD and its process CPU time per step. Target: blocking <= 1.0x DDP's step time,
   as the median over the rounds of the blocking/DDP ratio within each round.
2. 4 CPU processes as 2 simulated nodes x 2: wall time until the loss falls below a fixed value, DASO vs DDP.

Usage: ``python packages/pc-distributed/benchmarks/run_dp.py [--quick] [--out PATH]``.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from benchlib import Report, bench_args
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pc_distributed import DASO, DataParallel, DataParallelMultiGPU, DataParallelOptimizer, run_world


def mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(width // 2, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width // 2),
    )


def _data(width: int, steps: int, batch: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(world * batch, width // 2, generator=g),
            torch.randn(world * batch, width // 2, generator=g),
        )
        for _ in range(steps)
    ]


def step_worker(rank: int, width: int, steps: int, rounds: int, batch: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    world = dist.get_world_size()
    data = _data(width, steps, batch, world)
    sl = slice(rank * batch, (rank + 1) * batch)

    def build(mode: str) -> tuple[Any, Any, nn.Module]:
        net = mlp(width)
        sgd = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        if mode in ("ddp", "ddp (A/A control)"):
            return DistributedDataParallel(net), sgd, net
        if mode == "none":
            return net, sgd, net
        opt = DataParallelOptimizer(sgd)
        return DataParallel(net, optimizer=opt, blocking_parameter_updates=(mode == "blocking")), opt, net

    def run(mode: str) -> tuple[float, float, nn.Module]:
        model, opt, net = build(mode)
        dist.barrier()
        times = []
        cpu_start = time.process_time()
        for x, y in data:
            start = time.perf_counter()
            opt.zero_grad()
            ((model(x[sl]) - y[sl]) ** 2).mean().backward()
            opt.step()
            times.append(time.perf_counter() - start)
        cpu = (time.process_time() - cpu_start) / len(data)
        if isinstance(model, DataParallel):
            model.flush()
        return statistics.median(times[1:]), cpu, net

    # a second DDP measured alike is the A/A control: its ratio to DDP is the noise floor of the comparison
    modes = ["ddp", "blocking", "nonblocking", "none", "ddp (A/A control)"]
    samples: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    nets: dict[str, nn.Module] = {}
    for r in range(rounds):  # interleaved, order reversed every other round: drifts hit every mode alike
        for m in modes if r % 2 == 0 else modes[::-1]:
            t, c, nets[m] = run(m)
            samples[m].append(t)
            cpu[m].append(c)
    # single-process full-batch SGD reference
    ref = mlp(width)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    for x, y in data:
        sgd.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        sgd.step()
    errors = {
        m: max(
            float((a - b).detach().abs().max())
            for a, b in zip(nets[m].parameters(), ref.parameters(), strict=True)
        )
        for m in ("ddp", "blocking", "nonblocking")
    }
    params = sum(p.numel() for p in ref.parameters())
    return {
        "ms": {m: statistics.median(v) * 1e3 for m, v in samples.items()},
        # blocking / DDP within each round (adjacent in time), then the median over the rounds
        "ratios": [b / d for b, d in zip(samples["blocking"], samples["ddp"], strict=True)],
        "control_ratios": [c / d for c, d in zip(samples["ddp (A/A control)"], samples["ddp"], strict=True)],
        "cpu_ms": {m: statistics.median(v) * 1e3 for m, v in cpu.items()},
        "err": errors,
        "params": params,
    }


def time_to_loss_worker(
    rank: int, mode: str, width: int, target: float, max_epochs: int, bpe: int
) -> dict[str, Any]:
    torch.set_num_threads(1)
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(3)
    w_true = torch.randn(width, 1, generator=g) / width**0.5
    data = torch.randn(world, bpe, 32, width, generator=g)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))
    sgd = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    daso = None
    if mode == "daso":
        daso = DASO(
            sgd, total_epochs=max_epochs, warmup_epochs=1, cooldown_epochs=1, max_global_skips=4, local_size=2
        )
        model: nn.Module = DataParallelMultiGPU(net, daso)
    else:
        model = DistributedDataParallel(net)
    dist.barrier()
    start = time.perf_counter()
    reached, epochs = float("nan"), 0
    for _epoch in range(max_epochs):
        total = 0.0
        if daso is not None:
            daso.last_batch = bpe - 1
        for b in range(bpe):
            x = data[rank, b]
            sgd.zero_grad()
            loss = ((model(x) - x @ w_true) ** 2).mean()
            loss.backward()
            if daso is not None:
                daso.step()
            else:
                sgd.step()
            total += float(loss.detach())
        epochs += 1
        t = torch.tensor([total / bpe])
        dist.all_reduce(t)
        avg = float(t) / world
        if daso is not None:
            daso.epoch_loss_logic(avg, loss_globally_averaged=True)
        if avg < target:
            reached = time.perf_counter() - start
            break
    return {"seconds": reached, "epochs": epochs}


def main() -> None:
    args = bench_args("pc-distributed (data parallel)")
    report = Report("pc-distributed-dp")
    width, steps, rounds = (512, 8, 3) if args.quick else (1024, 20, 8)
    both = run_world(step_worker, 2, args=(width, steps, rounds, 64), init_rpc=False, timeout=400)
    res = both[0]
    ms = res["ms"]
    case = f"MLP {res['params'] / 1e6:.2f}M params, 2 procs, ms/step"
    report.row(case, "torch DDP", ms["ddp"], "ms", baseline=True)
    report.row(case, "pc DataParallel blocking", ms["blocking"], "ms")
    report.row(case, "pc DataParallel non-blocking", ms["nonblocking"], "ms")
    report.row(case, "no communication", ms["none"], "ms")
    report.row(case, "a second torch DDP (A/A control)", ms["ddp (A/A control)"], "ms")
    for m, e in res["err"].items():
        report.row("max |param - single-process SGD|", m, e, "abs")
    for m, v in res["cpu_ms"].items():
        report.row("process CPU time per step (rank 0, all threads), ms", m, v, "ms", baseline=(m == "ddp"))
    paired = max(statistics.median(r["ratios"]) for r in both)  # the slower rank's view
    control = max(statistics.median(r["control_ratios"]) for r in both)
    ratios = sorted(both[0]["ratios"])
    cpu_ratio = res["cpu_ms"]["blocking"] / res["cpu_ms"]["ddp"]
    load = ms["ddp"] / res["cpu_ms"]["ddp"]
    why = (
        f"per-round ratios {ratios[0]:.2f}-{ratios[-1]:.2f}x; the A/A control (a second DDP, same rounds) "
        f"measured {control:.3f}x, the noise floor of this comparison; process CPU time per step "
        f"{cpu_ratio:.2f}x DDP's, on a machine where a step's wall time was {load:.1f}x its CPU time "
        "(both all-reduce the same buckets with gloo: what differs is where the hooks run, Python or C++)"
    )
    report.target("blocking DP step time vs DDP", paired, "<=", 1.0, note="" if paired <= 1.0 else why)
    report.note(
        f"blocking/DDP step time: median over {rounds} rounds of the ratio within each round (adjacent runs, "
        "order reversed every other round), the larger of the 2 ranks; the machine is shared, so single "
        "medians drift by tens of percent between runs (see 'no communication')"
    )
    report.target(
        "blocking DP deviation from single-process SGD", res["err"]["blocking"], "<=", 1e-6, unit=""
    )
    report.target(
        "non-blocking DP deviation from single-process SGD", res["err"]["nonblocking"], "<=", 1e-6, unit=""
    )

    dwidth, max_epochs, bpe, target = (32, 12, 8, 0.05) if args.quick else (64, 30, 16, 0.02)
    secs = {}
    for mode in ("ddp", "daso"):
        out = run_world(
            time_to_loss_worker, 4, args=(mode, dwidth, target, max_epochs, bpe), init_rpc=False, timeout=400
        )[0]
        secs[mode] = out["seconds"]
        report.row(
            f"4 procs (2x2), time to loss < {target}", mode, out["seconds"], "s", baseline=(mode == "ddp")
        )
        if out["seconds"] != out["seconds"]:  # NaN: the target was not reached
            report.note(f"{mode}: loss target {target} not reached in {max_epochs} epochs")
        else:
            report.note(f"{mode}: loss target {target} reached after {out['epochs']} epochs")
    report.target("DASO time to fixed loss vs DDP", secs["daso"] / secs["ddp"], "<=", 1.0)
    report.note(
        "CPU/gloo on one machine: 'nodes' are simulated, so DASO's cross-node savings cannot show here."
    )
    report.finish(args)


if __name__ == "__main__":
    main()
