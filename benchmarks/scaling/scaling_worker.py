"""The worker of the scaling benchmark, started by torchrun (one per process of the job; see run.py).

``python scaling_worker.py <out_dir> <dp_steps> <pushes> <reps>``: every rank measures, in this order,

1. DataParallel (blocking) on a 2.1M-parameter MLP with a fixed batch per process (weak scaling): ``reps``
   times ``dp_steps`` timed steps (after 3 warm-up steps), each from one barrier to the next;
2. a PushPullGradServerImpl with its primary reducer on rank 0 and a secondary reducer on every rank, every
   rank a client pushing ``pushes`` gradients of 100k floats (a push returns once queued, then pulls the
   newest model), ``reps`` times, each timed from one barrier to the next; then the time until the primary
   applied every push.

Rank 0 writes ``<out_dir>/result.json`` (the slowest rank's times); the others write nothing. Times are
measured with a monotonic clock and only reported.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pc_distributed import DataParallel, DataParallelOptimizer, World

WAIT = 120.0  # seconds for a barrier on a loaded 2-core machine
WIDTH = 1024  # MLP 512 -> 1024 -> 1024 -> 512: 2.1M parameters (the pc-distributed benchmark's model)
BATCH = 64  # samples per process per step
GRAD = (4, 25_000)  # the gradient server's model: 4 tensors of 25k floats (the pc-server benchmark's)


def mlp() -> nn.Module:
    """The DataParallel model (seeded: the same on every rank)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH // 2, WIDTH),
        nn.ReLU(),
        nn.Linear(WIDTH, WIDTH),
        nn.ReLU(),
        nn.Linear(WIDTH, WIDTH // 2),
    )


class Blob(nn.Module):
    """The gradient server's model: ``n`` float32 tensors of ``size`` elements."""

    def __init__(self, n: int, size: int) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(size)) for _ in range(n)])


def data_parallel(group: Any, rank: int, steps: int, reps: int) -> list[float]:
    """Seconds for ``steps`` blocking DataParallel steps (barrier to barrier, this rank's view), per rep."""
    net = mlp()
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9))
    dp = DataParallel(net, optimizer=opt, blocking_parameter_updates=True)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(BATCH, WIDTH // 2, generator=g), torch.randn(BATCH, WIDTH // 2, generator=g)

    def step() -> None:
        opt.zero_grad()
        ((dp(x) - y) ** 2).mean().backward()
        opt.step()

    for _ in range(3):
        step()
    times = []
    for _ in range(reps):
        group.barrier(WAIT)
        start = time.monotonic()
        for _ in range(steps):
            step()
        group.barrier(WAIT)
        times.append(time.monotonic() - start)
    return times


def grad_server(group: Any, rank: int, pushes: int, reps: int) -> dict[str, Any]:
    """Push throughput of every rank as a client (barrier to barrier) and the time until all were applied."""
    from pc_server import PushPullGradServerImpl

    names = group.get_group_members()
    impl = PushPullGradServerImpl(
        "gs",
        group,
        primary_reducer=names[0],
        secondary_reducers=names,
        reduce_batch_size=4,
        flush_timeout=0.05,
    )
    if rank == 0:
        managed = Blob(*GRAD)
        impl.manage_model(managed, torch.optim.SGD(managed.parameters(), lr=1e-3))
    impl.start()
    group.barrier(WAIT)
    gs = group.get_paired("gs").to_here()
    model = Blob(*GRAD)
    grads = [torch.randn(GRAD[1]) for _ in range(GRAD[0])]

    def push() -> None:
        for p, g in zip(model.ps, grads, strict=True):
            p.grad = g.clone()
        gs.push(model)

    push()  # warm-up: the connections to every reducer
    out: dict[str, Any] = {"push_s": [], "push_cpu_s": []}
    for _ in range(reps):
        group.barrier(WAIT)
        start, cpu = time.monotonic(), time.process_time()
        for _ in range(pushes):
            push()
        group.barrier(WAIT)
        out["push_s"].append(time.monotonic() - start)
        out["push_cpu_s"].append(time.process_time() - cpu)  # this process, every thread (reducers, RPC)
    if rank == 0:  # wait until the primary has applied (or dropped) every push, warm-ups included
        total = len(names) * (reps * pushes + 1)
        deadline = time.monotonic() + WAIT
        while True:
            stats = impl.stats()
            if stats.applied + stats.pushes.dropped_overflow + stats.dropped_stale >= total:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the primary applied {stats.applied} of {total} pushes in {WAIT:g} s")
            time.sleep(0.002)
        out["drain_s"] = time.monotonic() - start  # after the last repetition's pushes began
        out["applied"] = float(stats.applied)
        out["dropped"] = float(stats.pushes.dropped_overflow + stats.dropped_stale)
        out["steps"] = float(stats.steps)
    group.barrier(WAIT)
    impl.stop(timeout=WAIT)
    impl.watch()
    group.barrier(WAIT)
    return out


def main() -> None:
    out, dp_steps, pushes, reps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    world = World(name=f"w{rank}", dist_timeout=WAIT, rpc_timeout=WAIT)
    size = world.world_size
    group = world.create_rpc_group("scaling", world.get_members())
    group.barrier(WAIT)
    dp_s = data_parallel(group, rank, dp_steps, reps)
    gs = grad_server(group, rank, pushes, reps)
    mine = {"rank": rank, "dp_s": dp_s, **gs}
    group.pair(f"result{rank}", mine)
    group.barrier(WAIT)
    if rank == 0:
        every = [group.get_paired(f"result{r}").to_here() for r in range(size)]
        result: dict[str, Any] = {
            "world_size": size,
            "hosts": int(os.environ.get("GROUP_WORLD_SIZE", "1")),
            "dp_steps": dp_steps,
            "batch": BATCH,
            "pushes_per_client": pushes,
            "reps": reps,
            # per repetition, the slowest rank's time (every rank runs between the same two barriers)
            "dp_s": [max(r["dp_s"][i] for r in every) for i in range(reps)],
            "push_s": [max(r["push_s"][i] for r in every) for i in range(reps)],
            # CPU seconds of each rank during the push phases (rank 0 hosts the primary reducer)
            "push_cpu_s": [sum(r["push_cpu_s"]) for r in every],
            "drain_s": gs["drain_s"],
            "applied": gs["applied"],
            "dropped": gs["dropped"],
            "server_steps": gs["steps"],
        }
        tmp = out / ".result.json"
        tmp.write_text(json.dumps(result))
        tmp.replace(out / "result.json")
    group.barrier(WAIT)
    world.stop(timeout=30)


if __name__ == "__main__":
    main()
