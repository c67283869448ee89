"""Where a gradient-server push spends its time, per leg, with 1, 2 and 4 processes on loopback.

``python packages/pc-server/benchmarks/scaling_legs.py [--points 1,2,4] [--pushes 40] [--reps 3]``, or
one point under torchrun (each worker in a session of its own, as the scaling benchmark runs):
``torchrun --standalone --nproc_per_node 4 packages/pc-server/benchmarks/scaling_legs.py --torchrun``.
For every point N, a local world of N processes (``run_world``) builds the scaling benchmark's gradient
server (every rank a client and a secondary reducer, the primary on rank 0, 4 tensors x 25k floats,
``reduce_batch_size=4``, ``flush_timeout=0.05``), and every client pushes ``pushes`` times, barrier to
barrier. Each leg is timed by wrapping the function that runs it (a monotonic clock; only reported, never
asserted):

- ``push``: the client's whole ``PushPullGradServer.push`` (the RPC to a secondary, then the pull);
- ``push_rpc``: the RPC to a secondary in another process (``call_service``), ``pull``: the pull after it;
- ``lookup``: directory look-ups in the store (``Directory.owner`` with ``refresh``);
- ``accept``: the secondary's handler; ``forward``: a secondary's bundle to the primary (RPC or direct call);
- ``step``: the primary's optimizer step with its publication; ``queue_wait``: how long pushes waited in the
  secondaries' queues before their batch was taken.

Also per rank: CPU seconds (``time.process_time``) over the pushes and the thread count. A profiling tool for
issue 20, not part of ``nox -s bench``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import pc_distributed
from pc_distributed import run_world

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks" / "scaling"))
from scaling_worker import GRAD, Blob, grad_server

WAIT = 120.0


_TIMES: dict[str, list[float]] = defaultdict(list)
_LOCK = threading.Lock()


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - start
            with _LOCK:
                _TIMES[name].append(elapsed)

    return wrapper


def _instrument() -> None:
    """Wrap the legs (in this process) with timers."""
    from pc_distributed.rpc import _directory as _rpc_directory
    from pc_server.grad import _primary_reducer, _secondary_reducer
    from pc_server.grad import client as grad_client

    grad_client.call_service = _timed("push_rpc", grad_client.call_service)  # type: ignore[assignment]
    grad_client.pull_model = _timed("pull", grad_client.pull_model)  # type: ignore[assignment]
    owner = _rpc_directory.Directory.owner

    def timed_owner(self: Any, kind: str, ktext: str, refresh: bool) -> Any:
        if not refresh:
            with self._lock:
                if (kind, ktext) in self._cache:
                    return self._cache[(kind, ktext)]
        return _timed("lookup", owner)(self, kind, ktext, refresh)

    _rpc_directory.Directory.owner = timed_owner  # type: ignore[method-assign]
    sec = _secondary_reducer.SecondaryReducer
    sec.accept = _timed("accept", sec.accept)  # type: ignore[method-assign]
    deliver = sec._deliver

    def timed_deliver(self: Any, kept: Any, clients: Any, batch: Any) -> Any:
        now = time.monotonic()
        with _LOCK:
            _TIMES["queue_wait"].extend(now - item.enqueued for item in batch)
        return _timed("forward", deliver)(self, kept, clients, batch)

    sec._deliver = timed_deliver  # type: ignore[method-assign]
    prim = _primary_reducer.PrimaryReducer
    prim._step = _timed("step", prim._step)  # type: ignore[method-assign]


def worker(rank: int, pushes: int, reps: int) -> dict[str, Any]:
    """One rank of a point: build the server, push ``pushes`` times per repetition, return the legs' times."""
    torch.set_num_threads(1)
    _instrument()
    world = pc_distributed.get_world()
    n = world.world_size
    names = [world.name_of(r) for r in range(n)]
    group = world.create_rpc_group("legs", names, timeout=WAIT)
    impl = grad_server("gs", group, names, rank)  # the scaling benchmark's, built the same way
    group.barrier(WAIT)
    client = group.get_paired("gs").to_here()
    model = Blob(*GRAD)
    grads = [torch.randn(GRAD[1]) for _ in range(GRAD[0])]
    total = 0

    def push() -> None:
        for p, g in zip(model.ps, grads, strict=True):
            p.grad = g.clone()
        client.push(model)

    def drained() -> bool:
        s = impl.stats()
        return s.applied + s.pushes.dropped_overflow + s.dropped_stale >= total

    def wait_drained() -> None:
        deadline = time.monotonic() + WAIT
        while not drained():  # the benchmark's own bounded wait (rank 0 only)
            if time.monotonic() > deadline:
                raise TimeoutError("not drained")
            time.sleep(0.001)

    timed_push = _timed("push", push)
    for _ in range(3):
        push()
    total += 3 * n
    if rank == 0:
        wait_drained()
    group.barrier(WAIT)
    with _LOCK:
        _TIMES.clear()
    runs = []
    for _ in range(reps):
        group.barrier(WAIT)
        start, cpu = time.monotonic(), time.process_time()
        for _ in range(pushes):
            timed_push()
        total += pushes * n
        group.barrier(WAIT)
        returned = time.monotonic() - start
        if rank == 0:
            wait_drained()
        applied = time.monotonic() - start
        group.barrier(WAIT)
        runs.append({"returned_s": returned, "applied_s": applied, "cpu_s": time.process_time() - cpu})
    threads = threading.active_count()
    group.barrier(WAIT)
    impl.stop(timeout=WAIT)
    impl.watch()
    group.barrier(WAIT)
    with _LOCK:
        times = {k: list(v) for k, v in _TIMES.items()}
    return {"runs": runs, "times": times, "threads": threads}


def _fmt(values: list[float]) -> str:
    if not values:
        return "-"
    p90 = sorted(values)[int(0.9 * (len(values) - 1))]
    return f"{statistics.median(values) * 1e3:7.2f} ms (n={len(values)}, p90 {p90 * 1e3:.2f})"


def _report(n: int, pushes: int, reps: int, results: list[dict[str, Any]]) -> None:
    """Print one point's throughput, CPU and legs (the repetition with the shortest applied time)."""
    total = n * pushes
    best = min(range(reps), key=lambda i: results[0]["runs"][i]["applied_s"])
    applied = results[0]["runs"][best]["applied_s"]
    returned = results[0]["runs"][best]["returned_s"]
    cpu = sum(r["runs"][best]["cpu_s"] for r in results)
    print(
        f"N={n}: {total / applied:6.1f} pushes/s applied, {total / returned:6.1f} returned, "
        f"CPU {cpu / total * 1e3:.2f} ms/push, {cpu / applied:.2f} CPU-s/s, "
        f"threads/rank {[r['threads'] for r in results]}"
    )
    for leg in sorted({k for r in results for k in r["times"]}):
        per_rank = "  ".join(f"r{i}: {_fmt(r['times'].get(leg, []))}" for i, r in enumerate(results))
        print(f"  {leg:10s} {per_rank}")


def _torchrun_main(pushes: int, reps: int) -> None:
    """Under torchrun: this rank's World from the environment; rank 0 prints."""
    import os

    rank = int(os.environ["RANK"])
    world = pc_distributed.World(name=f"w{rank}", dist_timeout=WAIT, rpc_timeout=WAIT)
    try:
        result = worker(rank, pushes, reps)
        group = world.create_rpc_group("report", world.get_members(), timeout=WAIT)
        group.pair(f"r{rank}", result)
        group.barrier(WAIT)
        if rank == 0:
            every = [group.get_paired(f"r{r}").to_here() for r in range(world.world_size)]
            _report(world.world_size, pushes, reps, every)
        group.barrier(WAIT)
    finally:
        world.stop(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--points", default="1,2,4")
    parser.add_argument("--pushes", type=int, default=40)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--torchrun", action="store_true", help="run under torchrun (one point: WORLD_SIZE)")
    args = parser.parse_args()
    if args.torchrun:
        _torchrun_main(args.pushes, args.reps)
        return
    for n in (int(p) for p in args.points.split(",")):
        results = run_world(worker, n, args=(args.pushes, args.reps), timeout=600, rpc_timeout=WAIT)
        _report(n, args.pushes, args.reps, results)


if __name__ == "__main__":
    main()
