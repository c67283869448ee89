"""pc-server benchmarks: ordered/model/gradient servers vs raw torch RPC with the same payload (3 processes).

Run: ``python packages/pc-server/benchmarks/run.py [--quick] [--out PATH]``. Rank 0 serves, rank 1 measures
(rank 2 is the second client of the gradient server). Ratios are ours / raw ``rpc_sync`` in the same run.
"""

from __future__ import annotations

import pathlib
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch
import torch.distributed.rpc as rpc
from benchlib import Report, bench_args, median_time
from torch import nn

from pc_server import OrderedServerSimpleImpl, PushPullGradServerImpl, PushPullModelServerImpl

_SINK: dict[str, Any] = {}


def echo(x: Any) -> Any:
    """Raw RPC peer: return the argument."""
    return x


def store(x: Any) -> bool:
    """Raw RPC peer: keep the payload (like a push)."""
    _SINK["x"] = x
    return True


def fetch() -> Any:
    """Raw RPC peer: send the kept payload back (like a pull)."""
    return _SINK["x"]


class Blob(nn.Module):
    """A model of ``n`` float32 tensors of ``size`` elements each."""

    def __init__(self, n: int, size: int) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(size)) for _ in range(n)])


class _SGD:
    def __init__(self, params: Any, lr: float = 1e-3) -> None:
        self.params, self.lr = list(params), lr

    def step(self) -> None:
        with torch.no_grad():
            for p in self.params:
                p -= self.lr * p.grad


def _bench_model(
    group: Any, label: str, n: int, size: int, repeat: int, number: int, out: dict[str, Any]
) -> None:
    ms = group.get_paired(f"ms_{label}").to_here()
    model = Blob(n, size)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rpc.rpc_sync("0", store, args=(state,))
    reps = max(3, repeat // 3)

    def full_pull() -> None:
        model.pp_version = -1
        ms.pull(model)

    cases = {
        f"raw_push_{label}": lambda: rpc.rpc_sync("0", store, args=(state,)),
        f"push_{label}": lambda: ms.push(model),
        f"raw_pull_{label}": lambda: rpc.rpc_sync("0", fetch),
        f"pull_{label}": full_pull,
    }
    rounds: dict[str, list[float]] = {key: [] for key in cases}
    for _ in range(3):  # interleaved rounds, so load changes on a shared machine hit ours and raw alike
        for key, fn in cases.items():
            rounds[key].append(median_time(fn, repeat=reps))
    for key, times in rounds.items():
        out[key] = sorted(times)[len(times) // 2]
    ms.pull(model)
    out[f"uptodate_pull_{label}"] = median_time(lambda: ms.pull(model), repeat=repeat, number=number)


def _rank(rank: int, quick: bool) -> dict[str, float]:
    torch.set_num_threads(1)
    from pc_distributed import get_world

    world = get_world()
    assert world is not None
    group = world.create_rpc_group("bench", ["0", "1", "2"])
    repeat = 5 if quick else 15
    number = 20 if quick else 100
    sizes = {"4MB": (10, 100_000)} if quick else {"4MB": (10, 100_000), "40MB": (10, 1_000_000)}
    grad_model = (4, 25_000)
    if rank == 0:
        OrderedServerSimpleImpl("kv", group)
        for label in sizes:
            PushPullModelServerImpl(f"ms_{label}", group)
        gm = Blob(*grad_model)
        gs = PushPullGradServerImpl(
            "gs", group, secondary_reducers=["0", "1"], reduce_batch_size=4, flush_timeout=0.05
        )
        gs.manage_model(gm, _SGD(gm.parameters()))
        gs.start()
        wm = Blob(1, 10)
        wake = PushPullGradServerImpl(
            "wake", group, secondary_reducers=["0"], reduce_batch_size=1, flush_timeout=None
        )
        wake.manage_model(wm, _SGD(wm.parameters()))
        wake.start()
        fl = Blob(1, 10)
        flush = PushPullGradServerImpl(
            "flush", group, secondary_reducers=["0"], reduce_batch_size=4, flush_timeout=0.2
        )
        flush.manage_model(fl, _SGD(fl.parameters()))
        flush.start()
        reducers = [gs, wake, flush]
    elif rank == 1:
        gs1 = PushPullGradServerImpl(
            "gs", group, secondary_reducers=["0", "1"], reduce_batch_size=4, flush_timeout=0.05
        )
        gs1.start()
        reducers = [gs1]
    else:
        reducers = []
    group.barrier(120)
    out: dict[str, float] = {}
    if rank == 1:
        kv = group.get_paired("kv").to_here()
        small = torch.zeros(4)
        kv.push("k", small, 0, None)
        for _ in range(3):  # interleaved rounds; medians of medians are taken below
            out.setdefault("raw_small", []).append(  # type: ignore[arg-type]
                median_time(lambda: rpc.rpc_sync("0", echo, args=(small,)), repeat=repeat, number=number)
            )
            out.setdefault("push_small", []).append(  # type: ignore[arg-type]
                median_time(lambda: kv.push("k", small, 0, 0), repeat=repeat, number=number)
            )
            out.setdefault("pull_small", []).append(  # type: ignore[arg-type]
                median_time(lambda: kv.pull("k"), repeat=repeat, number=number)
            )
        for label, (n, size) in sizes.items():
            _bench_model(group, label, n, size, repeat, number, out)
        wake = group.get_paired("wake").to_here()
        m = Blob(1, 10)
        lat = []
        for _ in range(10 if quick else 30):
            m.ps[0].grad = torch.zeros(10)
            t0 = time.perf_counter()
            v0 = m.pp_version if hasattr(m, "pp_version") else 0
            wake.push(m)
            while not (wake.pull(m) and m.pp_version > v0):
                pass  # spin on one-RPC pulls: measures push -> applied -> visible latency
            lat.append(time.perf_counter() - t0)
        out["wake_latency"] = sorted(lat)[len(lat) // 2]
        fl = group.get_paired("flush").to_here()
        m2 = Blob(1, 10)
        m2.ps[0].grad = torch.zeros(10)
        t0 = time.perf_counter()
        fl.push(m2)
        while not (fl.pull(m2) and m2.pp_version > 0):
            pass
        out["flush_latency"] = time.perf_counter() - t0
    group.barrier(120)
    if rank in (1, 2):  # gradient server: two clients push concurrently
        gs = group.get_paired("gs").to_here()
        gm = Blob(*grad_model)
        grads = {f"ps.{i}": torch.randn(grad_model[1]) for i in range(grad_model[0])}
        count = 40 if quick else 200
        t0 = time.perf_counter()
        for _ in range(count):
            for i, p in enumerate(gm.ps):
                p.grad = grads[f"ps.{i}"].clone()
            gs.push(gm)
        out["grad_push_s"] = (time.perf_counter() - t0) / count
        t0 = time.perf_counter()
        for _ in range(count):
            rpc.rpc_sync("0", store, args=(grads,))
            rpc.rpc_sync("0", echo, args=(0,))
        out["raw_grad_push_s"] = (time.perf_counter() - t0) / count
    group.barrier(120)
    for reducer in reducers:
        reducer.stop(timeout=60)
        reducer.watch()
    group.barrier(120)
    return out


def main() -> None:
    args = bench_args("pc-server")
    from pc_distributed import run_world

    results = run_world(_rank, 3, args=(args.quick,), timeout=170 if args.quick else 400, rpc_timeout=60)
    r1, r2 = results[1], results[2]
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    report = Report("pc-server")
    raw_small = med(r1["raw_small"])
    for key, label in (
        ("push_small", "OrderedServerSimple.push"),
        ("pull_small", "OrderedServerSimple.pull"),
    ):
        report.row("tiny value round trip", label, med(r1[key]))
    report.row("tiny value round trip", "raw rpc_sync", raw_small, baseline=True)
    report.target("small push vs raw rpc_sync", med(r1["push_small"]) / raw_small, "<=", 1.3)
    report.target("small pull vs raw rpc_sync", med(r1["pull_small"]) / raw_small, "<=", 1.3)
    for label in [k[len("push_") :] for k in r1 if k.startswith("push_") and k != "push_small"]:
        report.row(f"{label} model push", "PushPullModelServer.push", r1[f"push_{label}"])
        report.row(f"{label} model push", "raw rpc_sync(state)", r1[f"raw_push_{label}"], baseline=True)
        report.row(f"{label} model pull", "PushPullModelServer.pull", r1[f"pull_{label}"])
        report.row(f"{label} model pull", "raw rpc_sync -> state", r1[f"raw_pull_{label}"], baseline=True)
        report.row(f"{label} up-to-date pull", "PushPullModelServer.pull", r1[f"uptodate_pull_{label}"])
        report.row(f"{label} up-to-date pull", "raw rpc_sync no-op", raw_small, baseline=True)
        if label == "4MB":
            report.target("4 MB model push vs raw transfer", r1["push_4MB"] / r1["raw_push_4MB"], "<=", 1.5)
            report.target(
                "4 MB model pull vs raw transfer (design note)",
                r1["pull_4MB"] / r1["raw_pull_4MB"],
                "<=",
                1.2,
            )
            report.target("up-to-date pull vs no-op rpc_sync", r1["uptodate_pull_4MB"] / raw_small, "<=", 1.2)
    grad = (r1["grad_push_s"] + r2["grad_push_s"]) / 2
    raw = (r1["raw_grad_push_s"] + r2["raw_grad_push_s"]) / 2
    report.row("grad push+pull, 2 clients (100k floats)", "PushPullGradServer.push", grad)
    report.row("grad push+pull, 2 clients (100k floats)", "raw rpc_sync push + no-op", raw, baseline=True)
    report.row(
        "grad pushes per second (2 clients)", "PushPullGradServer", 2 / grad, "1/s", higher_is_better=True
    )
    report.target(
        "reducer wake-up (push -> applied -> pulled, B=1)", r1["wake_latency"] * 1e3, "<=", 5.0, "ms"
    )
    report.target(
        "partial flush (flush_timeout 200 ms) extra delay",
        (r1["flush_latency"] - 0.2) * 1e3,
        "<=",
        50.0,
        "ms",
    )
    report.note(
        "grad server: the gradient push is queued and applied asynchronously; its pull sends state when newer"
    )
    report.note("2-core shared machine: judge ratios measured in the same run, not absolute times")
    report.finish(args)


if __name__ == "__main__":
    main()
