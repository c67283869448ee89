"""Where the time goes on a GPU: pc-pickle's 256 MB copy, pc-pool's 4 MB share, c10d RPC, replica SyncBN.

A diagnostic to run beside tools/gpu_check.sh when tuning the CUDA rows: it prints timings of the pieces and
cProfile / torch.profiler tables, and asserts nothing (the benchmarks hold the targets). Run from the
repository root with every ``packages/*/src`` on PYTHONPATH (as gpu_check.sh sets it):
``python tools/gpu_profile.py [pickle] [pool] [rpc] [sync]`` (default: all four).
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

TIMEOUT = 60.0


def best(fn: Callable[[], Any], n: int = 5, sync: bool = True) -> float:
    """The least wall time of ``n`` calls of ``fn`` (the device synchronized around each when ``sync``)."""
    out = []
    for _ in range(n):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return min(out)


def top(prof: cProfile.Profile, n: int = 25, key: str = "cumulative") -> str:
    """The ``n`` first rows of ``prof``'s table sorted by ``key``."""
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(key).print_stats(n)
    return s.getvalue()


def pickle_section() -> None:
    """pc-pickle, 256 MB: the copies a dumps and a loads are made of, each alone, then both profiled."""
    import pc_pickle
    from pc_pickle import _device_copy

    print("threads", torch.get_num_threads())
    nbytes = 256_000_000
    w = torch.randn(nbytes // 4, device="cuda")
    obj = {"weight": w, "step": 3}
    wb = w.view(torch.uint8)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host = torch.empty(nbytes, dtype=torch.uint8)
    host.fill_(1)
    pool = _device_copy.staging_pool()
    print("pool chunk_bytes", pool.chunk_bytes, "bound", pool.bound_bytes)
    res = {}
    res["pinned D2H"] = best(lambda: pinned.copy_(wb, non_blocking=True))
    res["pinned H2D"] = best(lambda: wb.copy_(pinned, non_blocking=True))
    res["host copy pinned->touched"] = best(lambda: host.copy_(pinned), sync=False)
    res["bytearray alloc 256MB"] = best(lambda: bytearray(nbytes), sync=False)

    def fresh_copy() -> None:
        b = bytearray(nbytes)
        torch.frombuffer(b, dtype=torch.uint8).copy_(pinned)

    res["host copy pinned->fresh bytearray"] = best(fresh_copy, sync=False)

    def fresh_empty() -> None:
        t = torch.empty(nbytes, dtype=torch.uint8)
        t.copy_(pinned)

    res["host copy pinned->fresh torch.empty"] = best(fresh_empty, sync=False)
    dest = memoryview(bytearray(nbytes))
    dest[:] = b"\x01" * nbytes
    res["stage_to_host into touched"] = best(lambda: _device_copy.stage_to_host(wb, dest))
    res["stage_to_host into fresh"] = best(
        lambda: _device_copy.stage_to_host(wb, memoryview(bytearray(nbytes)))
    )
    payload = pc_pickle.dumps(obj)
    res["dumps"] = best(lambda: pc_pickle.dumps(obj))
    res["loads"] = best(lambda: pc_pickle.loads(payload))
    for k, v in res.items():
        print(f"{k:45s} {v * 1e3:8.2f} ms")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        pc_pickle.dumps(obj)
    prof.disable()
    print(top(prof, 30))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        pc_pickle.loads(payload)
    prof.disable()
    print(top(prof, 20, "tottime"))


def noop(x: Any) -> int:
    """A task that does nothing with its argument (the pool's own round trip)."""
    return 0


def add_one(t: torch.Tensor) -> None:
    """The benchmark's task: an in-place add on the shared tensor."""
    t.add_(1)
    torch.cuda.synchronize()


def start_prof() -> None:
    """A pool worker's initializer: profile the worker's main thread (kept on ``builtins``)."""
    import builtins

    p = cProfile.Profile()
    builtins._pc_prof = p  # type: ignore[attr-defined]
    p.enable()


def stop_prof() -> str:
    """A task: stop the worker's profile and return its tables."""
    import builtins

    p = builtins._pc_prof  # type: ignore[attr-defined]
    p.disable()
    return top(p, 35, "cumulative") + top(p, 20, "tottime")


def pool_section() -> None:
    """pc-pool, 4 MB CUDA share: round trips with and without the tensor, dumps alone, both sides profiled."""
    import pc_pickle
    import pc_pool

    t = torch.zeros(1_000_000, device="cuda")
    with pc_pool.Pool(1, is_copy_tensor=False, share_method="cuda", initializer=start_prof) as pool:
        for _ in range(5):
            pool.apply_async(add_one, (t,)).get(TIMEOUT)
        res = {}
        res["noop(1)"] = best(lambda: pool.apply_async(noop, (1,)).get(TIMEOUT), n=50)
        res["noop(t)"] = best(lambda: pool.apply_async(noop, (t,)).get(TIMEOUT), n=50)
        res["add_one(t)"] = best(lambda: pool.apply_async(add_one, (t,)).get(TIMEOUT), n=50)
        res["pc_pickle.dumps(t, share)"] = best(
            lambda: pc_pickle.dumps((add_one, (t,)), copy_tensor=False), n=50
        )
        from multiprocessing.reduction import ForkingPickler

        res["ForkingPickler.dumps(t)"] = best(lambda: ForkingPickler.dumps(t), n=50)
        for k, v in res.items():
            print(f"{k:45s} {v * 1e3:8.3f} ms")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            pool.apply_async(add_one, (t,)).get(TIMEOUT)
        prof.disable()
        print("PARENT\n", top(prof, 40, "tottime"))
        print("WORKER\n", pool.apply_async(stop_prof, ()).get(TIMEOUT))


def element_count(tensor: torch.Tensor) -> int:
    """The RPC service: a few bytes back."""
    return tensor.numel()


def _rpc_measure(rank: int) -> str:
    import pc_distributed as pd

    torch.cuda.set_device(0)
    world = pd.get_world()
    group = world.create_rpc_group("prof", ["0", "1"], timeout=TIMEOUT)
    if rank == 1:
        group.register("count", element_count)
    group.barrier(TIMEOUT)
    out = ""
    if rank == 0:
        tc = torch.ones(1 << 20, device="cuda")
        th = torch.ones(1 << 20)
        res = {}
        for name, arg in (("tiny", torch.ones(1)), ("cpu 4MB", th), ("cuda 4MB", tc)):
            for _ in range(3):
                group.registered_sync("count", args=(arg,), timeout=TIMEOUT)
            res[name] = best(lambda a=arg: group.registered_sync("count", args=(a,), timeout=TIMEOUT), n=20)
        out = "\n".join(f"{k:20s} {v * 1e3:8.3f} ms" for k, v in res.items())
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(30):
            group.registered_sync("count", args=(tc,), timeout=TIMEOUT)
        prof.disable()
        out += "\n" + top(prof, 40, "tottime")
    group.barrier(TIMEOUT)
    return out


def rpc_section() -> None:
    """c10d RPC, two ranks on cuda:0: a tiny, a 4 MB CPU and a 4 MB CUDA argument; the caller profiled."""
    import pc_distributed as pd

    got = pd.run_world(_rpc_measure, 2, rpc_backend="c10d", backend="gloo", start_method="spawn", timeout=120)
    print(got[0])


def sync_section() -> None:
    """Replica SyncBN, two replicas on cuda:0, against nn.DataParallel: step time, launches, ops."""
    from torch import nn
    from torch.profiler import ProfilerActivity, profile

    from pc_replicate import ReplicationCallbackDataParallel
    from pc_sync import SynchronizedBatchNorm2d

    x = torch.randn(32, 64, 28, 28, device="cuda")
    g = torch.randn_like(x)
    nets = {
        "pc [0,0]": ReplicationCallbackDataParallel(SynchronizedBatchNorm2d(64).cuda(), device_ids=[0, 0]),
        "torch [0,0]": nn.DataParallel(nn.BatchNorm2d(64).cuda(), device_ids=[0, 0]),
        "pc plain BN [0,0]": ReplicationCallbackDataParallel(nn.BatchNorm2d(64).cuda(), device_ids=[0, 0]),
    }
    for name, net in nets.items():

        def step(net: torch.nn.Module = net) -> None:
            xa = x.clone().requires_grad_()
            (net(xa) * g).sum().backward()

        for _ in range(10):
            step()
        print(name, f"{best(lambda: [step() for _ in range(20)], n=5) / 20 * 1e3:.3f} ms/step")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                step()
            torch.cuda.synchronize()
        ev = prof.key_averages()
        launches = sum(e.count for e in ev if "LaunchKernel" in e.key or "cudaLaunch" in e.key)
        print(name, "kernel launches per step", launches / 10)
        print(ev.table(sort_by="count", row_limit=30, max_name_column_width=60))


def main() -> None:
    """Run the sections named on the command line, each on its own (a failure prints and goes on)."""
    which = sys.argv[1:] or ["pickle", "pool", "rpc", "sync"]
    for name in which:
        print(f"===== {name}", flush=True)
        t0 = time.time()
        try:
            globals()[f"{name}_section"]()
        except Exception:
            traceback.print_exc()
        print(f"===== {name} took {time.time() - t0:.1f} s", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
