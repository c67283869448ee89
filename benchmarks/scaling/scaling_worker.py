"""The worker of the scaling benchmark, started by torchrun (one per process of the job; see run.py).

``python scaling_worker.py <out_dir> <points> <dp_steps> <pushes> <reps>``: one job measures every point of
an axis (``points``, comma-separated: the first N ranks of the job make the point N), interleaved, so a load
drift of the shared machine hits every point alike. For every point N the first N ranks build, once:

1. a blocking DataParallel of the 2.1M-parameter MLP on a collective group of the N ranks, a fixed batch of 64
   samples per process (weak scaling);
2. a PushPullGradServerImpl on an RPC group of the N ranks: the primary reducer on rank 0, a secondary reducer
   on every rank, every rank a client pushing gradients of 100k floats (a push returns once queued, then pulls
   the newest model).

Then ``reps`` times, for every point in turn (the order reversed every other repetition), the N ranks time
``dp_steps`` DataParallel steps and ``pushes`` pushes per client, each from one barrier of the N ranks to the
next, the pushes until the primary has applied (or dropped) every one of them; the other ranks wait on a
barrier of the whole job meanwhile. Rank 0, a member of every point, times them and writes
``<out_dir>/result.json``. Times are measured with a monotonic clock and only reported.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "packages" / "pc-distributed" / "benchmarks"))
import run_dp

WAIT = 180.0  # seconds for a barrier on a loaded 2-core machine
WIDTH = 1024  # MLP 512 -> 1024 -> 1024 -> 512: 2.1M parameters (the pc-distributed benchmark's model)
BATCH = 64  # samples per process per step
GRAD = (4, 25_000)  # the gradient server's model: 4 tensors of 25k floats (the pc-server benchmark's)


def mlp() -> nn.Module:
    """The DataParallel model, the pc-distributed benchmark's (seeded: the same on every rank)."""
    return run_dp.mlp(WIDTH)


class Blob(nn.Module):
    """The gradient server's model: ``n`` float32 tensors of ``size`` elements."""

    def __init__(self, n: int, size: int) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(size)) for _ in range(n)])


def grad_server(name: str, group: Any, names: list[str], rank: int) -> Any:
    """The benchmark's gradient server on ``group``, started: every member a secondary reducer, the primary
    on ``names[0]``, batches of 4 pushes or 50 ms; rank 0 manages the model (:class:`Blob`, plain SGD)."""
    from pc_server import PushPullGradServerImpl

    impl = PushPullGradServerImpl(
        name,
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
    return impl


class Point:
    """One point N of the axis, on one of its N ranks: its DataParallel and its gradient server."""

    def __init__(self, world: World, n: int, rank: int) -> None:
        self.n, self.rank = n, rank
        self.collective = world.create_collective_group(list(range(n)), timeout=WAIT)  # every rank calls
        if rank >= n:
            return
        net = mlp()
        self.opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9))
        self.dp = DataParallel(net, optimizer=self.opt, blocking_parameter_updates=True, comm=self.collective)
        g = torch.Generator().manual_seed(rank)
        self.x = torch.randn(BATCH, WIDTH // 2, generator=g)
        self.y = torch.randn(BATCH, WIDTH // 2, generator=g)
        names = [world.name_of(r) for r in range(n)]
        self.group = world.create_rpc_group(f"point{n}", names, timeout=WAIT)
        self.impl = grad_server(f"gs{n}", self.group, names, rank)
        self.group.barrier(WAIT)
        self.gs = self.group.get_paired(f"gs{n}").to_here()
        self.model = Blob(*GRAD)
        self.grads = [torch.randn(GRAD[1]) for _ in range(GRAD[0])]
        self.pushed = 0  # pushes of every client so far (rank 0 waits until the primary has them all)
        for _ in range(3):
            self.step()
        self.push()

    def step(self) -> None:
        """One DataParallel training step."""
        self.opt.zero_grad()
        ((self.dp(self.x) - self.y) ** 2).mean().backward()
        self.opt.step()

    def push(self) -> None:
        """One gradient push (and the pull that follows it)."""
        for p, g in zip(self.model.ps, self.grads, strict=True):
            p.grad = g.clone()
        self.gs.push(self.model)
        self.pushed += self.n

    def drained(self) -> bool:
        """Rank 0: the primary has applied or dropped every push so far."""
        stats = self.impl.stats()
        return stats.applied + stats.pushes.dropped_overflow + stats.dropped_stale >= self.pushed

    def wait_drained(self) -> None:
        """Rank 0: wait (bounded) until :meth:`drained`."""
        deadline = time.monotonic() + WAIT
        while not self.drained():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"point {self.n}: the primary did not apply {self.pushed} pushes in {WAIT} s"
                )
            time.sleep(0.001)

    def measure(self, dp_steps: int, pushes: int) -> dict[str, float]:
        """Time ``dp_steps`` steps and ``pushes`` pushes per client, barrier to barrier (rank 0's view)."""
        self.collective.barrier()
        start, cpu = time.monotonic(), time.process_time()
        for _ in range(dp_steps):
            self.step()
        self.collective.barrier()
        dp_s = time.monotonic() - start
        dp_cpu_s = time.process_time() - cpu
        if self.rank == 0:
            self.wait_drained()  # the warm-up's pushes (first repetition), so they cost no measurement
        self.collective.barrier()
        start, cpu = time.monotonic(), time.process_time()
        for _ in range(pushes):
            self.push()
        self.collective.barrier()
        returned_s = time.monotonic() - start
        if self.rank == 0:
            self.wait_drained()
        applied_s = time.monotonic() - start
        self.collective.barrier()  # the others' CPU time includes the drain (their secondaries forward)
        cpu_s = time.process_time() - cpu
        return {
            "dp_s": dp_s,
            "dp_cpu_s": dp_cpu_s,
            "push_returned_s": returned_s,
            "push_s": applied_s,
            "push_cpu_s": cpu_s,
        }

    def stop(self) -> dict[str, float]:
        """Stop the gradient server; return its counters (rank 0)."""
        stats = self.impl.stats()
        out = {
            "applied": float(stats.applied),
            "dropped": float(stats.dropped_overflow + stats.dropped_stale),
        }
        self.group.barrier(WAIT)
        self.impl.stop(timeout=WAIT)
        self.impl.watch()
        self.group.barrier(WAIT)
        return out


def main() -> None:
    out = Path(sys.argv[1])
    points = [int(p) for p in sys.argv[2].split(",")]
    dp_steps, pushes, reps = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    world = World(name=f"w{rank}", dist_timeout=WAIT, rpc_timeout=WAIT)
    everyone = world.create_rpc_group("everyone", world.get_members(), timeout=WAIT)
    built = [Point(world, n, rank) for n in points]
    samples: dict[int, list[dict[str, float]]] = {n: [] for n in points}
    for rep in range(reps):
        for point in built if rep % 2 == 0 else reversed(built):
            everyone.barrier(WAIT)
            if rank < point.n:
                samples[point.n].append(point.measure(dp_steps, pushes))
    everyone.pair(
        f"cpu{rank}", {n: [(r["dp_cpu_s"], r["push_cpu_s"]) for r in s] for n, s in samples.items()}
    )
    everyone.barrier(WAIT)
    if rank == 0:
        every = [everyone.get_paired(f"cpu{r}").to_here() for r in range(world.world_size)]
        for n, reps_of in samples.items():  # CPU seconds of the point's N ranks together, per repetition
            for i, record in enumerate(reps_of):
                record["all_dp_cpu_s"] = sum(e[n][i][0] for e in every[:n])
                record["all_push_cpu_s"] = sum(e[n][i][1] for e in every[:n])
    everyone.barrier(WAIT)  # rank 0 has every rank's CPU times
    counters = {p.n: p.stop() for p in built if rank < p.n}
    everyone.barrier(WAIT)
    if rank == 0:
        result = {
            "world_size": world.world_size,
            "hosts": int(os.environ.get("GROUP_WORLD_SIZE", "1")),
            "points": points,
            "dp_steps": dp_steps,
            "batch": BATCH,
            "pushes_per_client": pushes,
            "reps": reps,
            "samples": {str(n): s for n, s in samples.items()},
            "counters": {str(n): c for n, c in counters.items()},
        }
        tmp = out / ".result.json"
        tmp.write_text(json.dumps(result))
        tmp.replace(out / "result.json")
    world.stop(timeout=30)


if __name__ == "__main__":
    main()
