"""Rank functions for the multi-process pc-server tests (run by pc_distributed.run_world in spawned children).

Each function runs several checks in one world and returns a dict of observations; the test modules assert on
them, so a failure names the check. Waits are bounded (wait_for_version, barriers with timeouts); no sleeps.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import torch
from server_models import HalvingScheduler, PlainSGD, ThreeLayer, Wide, backward_once

import pc_distributed as pd
from pc_server import (
    OrderedServerSimpleImpl,
    PushPullGradServerImpl,
    PushPullModelServerImpl,
    grad_server_helper,
)

BARRIER_S = 60.0


class _CallCounter:
    """Counts the calls this process sends through its World's RPC backend (either backend) while active.

    The World's backend is swapped for a proxy that counts ``call_sync``/``call``/``remote`` and hands every
    attribute on to the backend; the World reads its backend at each call, so every RPC of pc-server counts.
    """

    _SENDS = frozenset(("call_sync", "call", "remote"))

    def __init__(self) -> None:
        self.count = 0
        world = pd.get_world()
        assert world is not None
        assert world.rpc_agent is not None
        self._world = world
        self._backend = world.rpc_agent

    def __getattr__(self, name: str) -> Any:  # the proxy's side: only for names the counter lacks
        attr = getattr(self._backend, name)
        if name not in self._SENDS:
            return attr

        def counted(*a: Any, **kw: Any) -> Any:
            self.count += 1
            return attr(*a, **kw)

        return counted

    def __enter__(self) -> _CallCounter:
        self._world.rpc_agent = self  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        self._world.rpc_agent = self._backend


def _bump(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p += 1


def happy_world(rank: int) -> dict[str, Any]:
    """Model server, ordered-server CAS across processes, both machin grad-server examples, and the helper."""
    torch.set_num_threads(1)
    from pc_distributed import get_world

    world = get_world()
    assert world is not None
    out: dict[str, Any] = {}
    group = world.create_rpc_group("g", ["0", "1", "2"])
    impls: list[Any] = []
    if rank == 0:
        impls.append(PushPullModelServerImpl("ms", group))
        impls.append(OrderedServerSimpleImpl("kv", group))
        big_server = PushPullModelServerImpl("ms_big", group)
        for method in ("sum", "mean"):
            model = ThreeLayer()
            impl = PushPullGradServerImpl(
                f"gs_{method}",
                group,
                secondary_reducers=["0"],
                reduce_method=method,
                reduce_batch_size=2,
                flush_timeout=None,
            )
            impl.manage_model(model, PlainSGD(model.parameters()))
            impl.start()
            impls.append(impl)
    group.barrier(BARRIER_S)

    # --- model server: ten pushes from rank 1, one RPC each; rank 2 pulls and pushes stale
    ms = group.get_paired("ms").to_here()
    if rank == 1:
        model = ThreeLayer()
        _bump(model)
        ms.push(model)  # the first of ten pushes also warms the owner cache
        counts = []
        for _ in range(9):
            _bump(model)
            with _CallCounter() as counter:
                ok = ms.push(model)
            counts.append((ok, counter.count))
        out["push_counts"] = counts
        out["pp_version"] = model.pp_version
    group.barrier(BARRIER_S)
    if rank == 2:
        fresh = ThreeLayer()
        ms.pull(fresh)
        out["pulled"] = fresh.weights()
        with _CallCounter() as counter:
            ms.pull(fresh)
        out["uptodate_pull_calls"] = counter.count
        stale = ThreeLayer()
        stale.pp_version = 3
        with _CallCounter() as counter:
            out["stale_push"] = ms.push(stale)
        out["stale_push_calls"] = counter.count
        out["stale_adopted"] = (stale.weights(), stale.pp_version)

    # --- model server with large tensors (sent without a client-side copy): snapshots on both sides
    big = group.get_paired("ms_big").to_here()
    wide = Wide()
    if rank == 1:
        wide.fill(1.0)
        out["big_push"] = big.push(wide)
        wide.fill(-1.0)  # mutating the client after its push must not reach the server's copy
    group.barrier(BARRIER_S)
    if rank == 2:
        out["big_pulled"] = (big.pull(wide), wide.pp_version, wide.values())
        wide.fill(-2.0)  # nor may mutating what was pulled
        wide.pp_version = 0
        big.pull(wide)
        out["big_repulled"] = wide.values()
    group.barrier(BARRIER_S)
    if rank == 0:  # the serving process pushes through RPC to itself, then mutates and pulls
        wide.pp_version = 1
        wide.fill(3.0)
        params = [id(p) for p in wide.parameters()]
        with _CallCounter() as counter:  # the server lives here: called directly, no RPC to itself
            out["big_self_push"] = big.push(wide)
            wide.fill(-3.0)
            wide.pp_version = 0
            big.pull(wide)
        out["big_self_calls"] = counter.count
        out["big_self_pulled"] = (
            wide.pp_version,
            wide.values(),
            params == [id(p) for p in wide.parameters()],
        )
        wide.fill(-4.0)
        hosted = big_server.o_server_impl
        assert hosted is not None
        found = hosted.peek("model")  # the stored object itself
        assert found is not None
        stored, version = found
        out["big_stored"] = (
            version,
            sorted({v for t in stored.large.values() for v in t.flatten().tolist()}),
        )

    # --- ordered server: ranks 1 and 2 race on one prev_version; rank 0 pushes through RPC to itself
    kv = group.get_paired("kv").to_here()
    if rank == 0:
        kv.push("c", torch.zeros(2), 0, None)
    group.barrier(BARRIER_S)
    if rank in (1, 2):
        out["cas_win"] = kv.push("c", torch.full((2,), float(rank)), 1, 0)
    group.barrier(BARRIER_S)
    if rank == 0:
        value, version = kv.pull("c")
        out["cas_head"] = (value.tolist(), version)
        mine = torch.ones(2)
        with _CallCounter() as counter:
            kv.push("self", mine, 1, None)
            mine.add_(5)
            pulled = kv.pull("self")[0]
            pulled.add_(7)  # nor may mutating what was pulled reach the server
            out["self_snapshot"] = (pulled.tolist(), kv.pull("self")[0].tolist())
        out["self_kv_calls"] = counter.count
        out["local_grad_push"] = _local_grad_push(group)

    # --- gradient server, machin's example, sum and mean (two pushes from each client)
    for method in ("sum", "mean"):
        gs = group.get_paired(f"gs_{method}").to_here()
        if rank in (1, 2):
            model = ThreeLayer()
            for _ in range(2):
                backward_once(model)
                model.pp_version = 0
                gs.push(model)
        if rank == 0:
            primary = impls[1 + 1 + (0 if method == "sum" else 1)]
            out[f"gs_{method}_reached"] = primary.wait_for_version(1, BARRIER_S)
            primary.watch()
        group.barrier(BARRIER_S)
        if rank in (1, 2):
            model = ThreeLayer()
            gs.pull(model)
            out[f"gs_{method}"] = model.weights()
    # --- grad_server_helper: every reducer runs, the lr scheduler steps, the managed model stays put
    servers = grad_server_helper(
        [ThreeLayer],
        group_name="helper",
        optimizer=PlainSGD,
        learning_rate=0.5,
        lr_scheduler=HalvingScheduler,
        timeout=BARRIER_S,
    )
    (helper,) = servers
    if rank in (1, 2):
        model = ThreeLayer()
        for i in range(3):
            backward_once(model)
            helper.set_seed(rank * 10 + i)
            out.setdefault("helper_routes", []).append(helper.next_secondary())
            helper.push(model)
    group.barrier(BARRIER_S)
    if rank != 0:
        servers.stop(timeout=BARRIER_S)  # secondaries drain into the primary first
    group.barrier(BARRIER_S)
    if rank == 0:
        impl = servers.impls[0]
        managed = impl.model
        ids = [id(p) for p in managed.parameters()]
        servers.stop(timeout=BARRIER_S)
        stats = impl.stats()
        out["helper_applied"] = stats.applied
        out["helper_steps"] = stats.steps
        out["helper_lr"] = impl.optimizer.param_groups[0]["lr"]
        out["helper_identity"] = ids == [id(p) for p in managed.parameters()]
        for impl in impls:
            if isinstance(impl, PushPullGradServerImpl):
                impl.stop(timeout=BARRIER_S)
    out["received"] = sum(i.stats().received for i in servers.impls)
    group.barrier(BARRIER_S)
    return out


def _local_grad_push(group: Any) -> dict[str, Any]:
    """Rank 0: a client on the reducers' own process pushes twice (no RPC); its gradient tensors are mutated
    between the pushes, which must not reach the queued first push (the batch of 2 waits for the second)."""
    managed = Wide()
    managed.fill(0.0)
    impl = PushPullGradServerImpl(
        "gs_local", group, secondary_reducers=["0"], reduce_batch_size=2, flush_timeout=None
    )
    impl.manage_model(managed, PlainSGD(managed.parameters()))
    impl.start()
    client = group.get_paired("gs_local").to_here()
    model = Wide()
    out: dict[str, Any] = {}
    with _CallCounter() as counter:
        for value in (1.0, 2.0):
            grads = [torch.full_like(p, value) for p in model.parameters()]
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g
            out.setdefault("accepted", []).append(client.push(model))
            for g in grads:
                g.fill_(100.0)  # the client's tensors change after the push returned
    out["calls"] = counter.count
    impl.stop(
        timeout=BARRIER_S
    )  # the secondary forwards its batch of 2; the primary applies it while draining
    impl.watch()
    out["steps"] = impl.stats().steps
    client.pull(model)
    out["weights"] = model.values()[:2]  # weight and bias: 0 - (1 + 2) with lr 1
    ledger = impl.ledger().clients[client.client_id]
    out["ledger"] = (ledger.accepted, ledger.applied)
    return out


class _HangingPull(OrderedServerSimpleImpl):
    """An ordered server whose pull handler hangs (bounded) until released."""

    release = threading.Event()

    def _pull_service(self, key: Any, version: Any = None) -> Any:
        self.release.wait(30.0)
        return super()._pull_service(key, version)


def failure_world(rank: int, report_dir: str) -> None:
    """Client death, a hung handler, then server death; rank 1 writes what it saw to report_dir.

    Rank 2 dies by SIGKILL after one push; rank 1 keeps using the server (rank 0), checks a hung handler times
    out, then rank 0 dies by SIGKILL and rank 1 measures how fast its next call fails.
    """
    import json

    torch.set_num_threads(1)
    from pc_distributed import get_world

    world = get_world()
    assert world is not None
    group = world.create_rpc_group("f", ["0", "1", "2"])
    pair = world.create_rpc_group("f01", ["0", "1"]) if rank in (0, 1) else None
    clients = world.create_rpc_group("f12", ["1", "2"]) if rank in (1, 2) else None
    if rank == 0:
        PushPullModelServerImpl("ms", group)
        _HangingPull("hang", group)
    group.barrier(BARRIER_S)
    ms = group.get_paired("ms").to_here()
    model = ThreeLayer()
    if rank == 2:
        assert clients is not None
        ms.push(model)
        clients.barrier(BARRIER_S)
        os.kill(os.getpid(), signal.SIGKILL)  # a client dies right after its push
    assert pair is not None
    if rank == 0:
        pair.barrier(BARRIER_S)  # rank 1 finished the checks that need a live server
        os.kill(os.getpid(), signal.SIGKILL)
    report: dict[str, Any] = {}
    assert clients is not None
    clients.barrier(BARRIER_S)  # rank 2 pushed and is dying now
    deadline = time.monotonic() + BARRIER_S
    _bump(model)
    report["push_after_client_death"] = ms.push(model)  # refused (stale): adopts version 1
    report["adopted"] = model.pp_version
    report["push_again"] = ms.push(model)
    hang = group.get_paired("hang").to_here()
    start = time.monotonic()
    try:
        hang.pull("x")
        report["hung"] = ["returned", 0.0, ""]
    except Exception as exc:
        report["hung"] = [type(exc).__name__, time.monotonic() - start, str(exc)[:300]]
    pair.barrier(BARRIER_S)
    outcome: list[Any] = ["no error", 0.0, ""]
    while time.monotonic() < deadline:
        start = time.monotonic()
        try:
            ms.pull(model)
        except Exception as exc:
            outcome = [type(exc).__name__, time.monotonic() - start, str(exc)[:300]]
            break
    report["server_dead"] = outcome
    with open(os.path.join(report_dir, "rank1.json"), "w") as fh:
        json.dump(report, fh)
    world.stop(timeout=5.0, graceful=False)  # peers are dead: a graceful shutdown would wait out its timeout
