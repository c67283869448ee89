"""Times of the gradient server's fault matrix (docs/server.md, "Fault matrix"), one small world per fault.

Run: ``python packages/pc-server/benchmarks/faults.py [--out PATH]``. Each row is measured once per run, over
real RPC (TensorPipe on loopback) with ``rpc_timeout=4 s``; the table printed at the end is what the docs
quote. The worlds: '0' is the primary reducer (and a secondary unless said otherwise), '1' a secondary, '2'
the client; a fault is injected by SIGKILL or by a handler that hangs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pc_server import REDUCE_SLAVE, OrderedServerSimpleImpl, PushPullGradServerImpl

RPC_TIMEOUT = 4.0
WAIT_S = 60.0


class Three(nn.Module):
    """Three scalar weights."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))


class _SGD:
    def __init__(self, params: Any) -> None:
        self.params = list(params)

    def step(self) -> None:
        with torch.no_grad():
            for p in self.params:
                p -= p.grad


class _HangingPull(OrderedServerSimpleImpl):
    """An ordered server whose pull handler hangs (bounded) until released."""

    release = threading.Event()

    def _pull_service(self, key: Any, version: Any = None) -> Any:
        self.release.wait(30.0)
        return super()._pull_service(key, version)


class _HangingPush(PushPullGradServerImpl):
    """A gradient server whose push handler hangs (bounded) until released."""

    release = threading.Event()

    def _push_service(self, message: Any, level: int = REDUCE_SLAVE) -> Any:
        self.release.wait(30.0)
        return super()._push_service(message, level)


def _server(
    group: Any, rank: int, name: str, secondaries: list[str], kind: type = PushPullGradServerImpl, **kw: Any
) -> PushPullGradServerImpl:
    impl = kind(name, group, primary_reducer="0", secondary_reducers=secondaries, **kw)
    if rank == 0:
        model = Three()
        impl.manage_model(model, _SGD(model.parameters()))
    impl.start()
    return impl


def _timed(call: Any) -> tuple[str, float, str]:
    """Run ``call``; return (outcome or exception type, seconds, repr or message)."""
    start = time.monotonic()
    try:
        value = call()
        return "returned", time.monotonic() - start, repr(value)
    except Exception as exc:
        return type(exc).__name__, time.monotonic() - start, str(exc)[:160]


def _push(gs: Any, model: Three) -> bool:
    model.w.grad = torch.ones(3)
    return bool(gs.push(model))


def _ledger(impl_or_client: Any) -> dict[str, int]:
    return dataclasses.asdict(impl_or_client.ledger().total)


def _world(rank: int) -> Any:
    from pc_distributed import get_world

    torch.set_num_threads(1)
    world = get_world()
    assert world is not None
    return world


def calm_world(rank: int, out_dir: str) -> None:
    """No process dies: a push's normal time, a stale push, stop() with pushes queued, a hung pull."""
    world = _world(rank)
    group = world.create_rpc_group("r", ["0", "1"])
    fast = _server(group, rank, "fast", ["0"], reduce_batch_size=1, max_staleness=0) if rank == 0 else None
    queued = (
        _server(group, rank, "queued", ["0"], reduce_batch_size=4, flush_timeout=None) if rank == 0 else None
    )
    hang = _HangingPull("hang", group) if rank == 0 else None
    slow = _server(group, rank, "slow", ["0"], _HangingPush) if rank == 0 else None
    group.barrier(WAIT_S)
    rows: dict[str, Any] = {}
    if rank == 1:
        gs = group.get_paired("fast").to_here()
        model = Three()
        gs.pull(model)
        times = [_timed(lambda: _push(gs, model))[1] for _ in range(20)]
        rows["push (normal)"] = ["returned True", sorted(times)[len(times) // 2], "median of 20"]
        stale = Three()
        gs.pull(stale)
        _push(gs, model)  # the model moves on while `stale` computed on the old version
        deadline = time.monotonic() + WAIT_S
        while model.pp_version <= stale.pp_version and time.monotonic() < deadline:
            gs.pull(model)
        rows["stale push"] = list(_timed(lambda: _push(gs, stale)))
        rows["stale push ledger"] = _ledger(gs)
        q = group.get_paired("queued").to_here()
        qm = Three()
        q.pull(qm)
        for _ in range(3):  # a partial batch: it waits (no flush timeout) until stop()
            _push(q, qm)
        h = group.get_paired("hang").to_here()
        rows["pull, handler hangs"] = list(_timed(lambda: h.pull("x")))
        s = group.get_paired("slow").to_here()
        sm = Three()
        s.pull(sm)
        rows["push, handler hangs"] = list(_timed(lambda: _push(s, sm)))
    group.barrier(WAIT_S)
    if rank == 0:
        assert queued is not None
        assert fast is not None
        assert hang is not None
        rows["stop() with 3 pushes queued"] = list(_timed(lambda: queued.stop(timeout=WAIT_S)))
        rows["stop() ledger"] = _ledger(queued)
        fast.stop(timeout=WAIT_S)
        hang.release.set()
        _HangingPush.release.set()
        assert slow is not None
        slow.stop(timeout=WAIT_S)
    _write(out_dir, f"calm{rank}", rows)
    group.barrier(WAIT_S)


def secondary_dies_world(rank: int, out_dir: str) -> None:
    """Secondary '1' is SIGKILLed; the client's pushes that rotate to it fail over to '0'."""
    world = _world(rank)
    group = world.create_rpc_group("r", ["0", "1", "2"])
    calm = world.create_rpc_group("calm", ["0", "2"]) if rank != 1 else None
    impl = _server(group, rank, "gs", ["0", "1"], reduce_batch_size=1) if rank in (0, 1) else None
    group.barrier(WAIT_S)
    rows: dict[str, Any] = {}
    if rank == 2:
        gs = group.get_paired("gs").to_here()
        model = Three()
        gs.pull(model)
        _push(gs, model)
        _push(gs, model)
    group.barrier(WAIT_S)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 2:
        pushes = [_timed(lambda: _push(gs, model)) for _ in range(4)]
        rows["pushes after the secondary died"] = pushes
        rows["slowest"] = max(pushes, key=lambda p: p[1])
        rows["ledger of all reducers"] = list(_timed(lambda: gs.ledger()))
        _write(out_dir, "secondary2", rows)
    assert calm is not None
    calm.barrier(WAIT_S)  # the client is done
    if rank == 0:
        assert impl is not None
        impl.stop(timeout=WAIT_S, secondaries_timeout=0)
        _write(out_dir, "secondary0", {"primary ledger": _ledger(impl)})
    calm.barrier(WAIT_S)
    world.stop(timeout=5.0, graceful=False)


def primary_dies_world(rank: int, out_dir: str) -> None:
    """The primary '0' (no secondary) is SIGKILLed; the client's next push and pull."""
    world = _world(rank)
    group = world.create_rpc_group("r", ["0", "1", "2"])
    calm = world.create_rpc_group("calm", ["1", "2"]) if rank != 0 else None
    impl = _server(group, rank, "gs", ["1"], reduce_batch_size=1) if rank in (0, 1) else None
    group.barrier(WAIT_S)
    if rank == 2:
        gs = group.get_paired("gs").to_here()
        model = Three()
        gs.pull(model)
        _push(gs, model)
    group.barrier(WAIT_S)
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    rows: dict[str, Any] = {}
    if rank == 2:
        first = ("returned", 0.0, "")
        deadline = time.monotonic() + WAIT_S
        while first[0] == "returned" and time.monotonic() < deadline:  # until the kill has landed
            first = _timed(lambda: gs.pull(model))
        rows["pull after the primary died"] = list(first)
        rows["push after the primary died"] = list(_timed(lambda: _push(gs, model)))
        rows["push after that"] = list(_timed(lambda: _push(gs, model)))
        _write(out_dir, "primary2", rows)
    assert calm is not None
    calm.barrier(WAIT_S)  # the client is done
    if rank == 1:
        assert impl is not None
        stopped = _timed(lambda: impl.stop(timeout=WAIT_S, secondaries_timeout=0))
        watched = _timed(impl.watch)
        rows = {"secondary stop": list(stopped), "watch()": list(watched), "secondary ledger": _ledger(impl)}
        _write(out_dir, "primary1", rows)
    calm.barrier(WAIT_S)
    world.stop(timeout=5.0, graceful=False)


def client_dies_world(rank: int, out_dir: str) -> None:
    """Client '3' is SIGKILLed while it pushes in a loop; client '2' keeps pushing."""
    world = _world(rank)
    group = world.create_rpc_group("r", ["0", "1", "2", "3"])
    calm = world.create_rpc_group("calm", ["0", "1", "2"]) if rank != 3 else None
    impl = _server(group, rank, "gs", ["0", "1"], reduce_batch_size=1) if rank in (0, 1) else None
    group.barrier(WAIT_S)
    gs = group.get_paired("gs").to_here() if rank in (2, 3) else None
    model = Three()
    if gs is not None:
        gs.pull(model)
    if rank == 3:
        Path(out_dir, "victim.pid").write_text(f"{os.getpid()} {gs.client_id if gs else ''}")
        while True:  # until rank 2 kills it, mid-push most of the time
            _push(gs, model)
    rows: dict[str, Any] = {}
    if rank == 2:
        assert gs is not None
        pid_file = Path(out_dir, "victim.pid")
        deadline = time.monotonic() + WAIT_S
        while not pid_file.exists() and time.monotonic() < deadline:
            gs.pull(model)  # one bounded RPC; the victim writes the file right before it pushes
        pid, victim = pid_file.read_text().split()
        while gs.ledger().clients.get(victim) is None or gs.ledger().clients[victim].accepted < 20:
            _push(gs, model)
        os.kill(int(pid), signal.SIGKILL)
        after = [_timed(lambda: _push(gs, model)) for _ in range(10)]
        rows["pushes by another client right after"] = after
        rows["slowest"] = max(after, key=lambda p: p[1])
        rows["victim"] = victim
    assert calm is not None
    calm.barrier(WAIT_S)
    if impl is not None:
        impl.stop(timeout=WAIT_S)
    calm.barrier(WAIT_S)
    if rank == 2:
        assert gs is not None
        ledger = gs.ledger()
        rows["victim ledger"] = dataclasses.asdict(ledger.clients[rows["victim"]])
        rows["balanced"] = ledger.balanced()
        _write(out_dir, "client2", rows)
    calm.barrier(WAIT_S)
    world.stop(timeout=5.0, graceful=False)


def _write(out_dir: str, name: str, rows: dict[str, Any]) -> None:
    Path(out_dir, f"{name}.json").write_text(json.dumps(rows, indent=1, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="write every measurement as JSON here")
    args = parser.parse_args()
    import pc_distributed

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn, size in (
            ("calm", calm_world, 2),
            ("secondary", secondary_dies_world, 3),
            ("primary", primary_dies_world, 3),
            ("client", client_dies_world, 4),
        ):
            start = time.monotonic()
            try:
                pc_distributed.run_world(
                    fn,
                    size,
                    args=(tmp,),
                    timeout=240,
                    rpc_timeout=RPC_TIMEOUT,
                    dist_timeout=30,
                    grace_period=60,
                )
            except pc_distributed.RankDiedError as exc:
                print(f"{name}: a rank died as meant ({str(exc)[:80]})")
            print(f"{name} world: {time.monotonic() - start:.1f} s")
        for path in sorted(Path(tmp).glob("*.json")):
            results[path.stem] = json.loads(path.read_text())
    print(json.dumps(results, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
