"""Threads sharing one pc-server object: the helpers of test_server_threads.py (also run in spawned children).

``hammer`` runs a function on several threads released together by a barrier; ``shared_client_world`` is the
rank function of the over-RPC check. Every wait is bounded; nothing sleeps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from server_models import PlainSGD, ThreeLayer

from pc_server import GradLedger, PushPullGradServer, PushPullGradServerImpl

WAIT = 60.0


def hammer(threads: int, work: Callable[[int], Any]) -> list[Any]:
    """Run ``work(i)`` on ``threads`` threads started together; the results (re-raises the first error)."""
    start = threading.Barrier(threads, timeout=WAIT)
    results: list[Any] = [None] * threads
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            start.wait()
            results[i] = work(i)
        except BaseException as exc:
            errors.append(exc)

    pool = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(WAIT)
    alive = [t.name for t in pool if t.is_alive()]
    if alive:
        raise TimeoutError(f"threads {alive} did not finish within {WAIT} s")
    if errors:
        raise errors[0]
    return results


def push_ones(client: PushPullGradServer, pushes: int) -> int:
    """Push gradients of ones ``pushes`` times from a model of this thread's own; count the accepted."""
    model = ThreeLayer()
    accepted = 0
    for _ in range(pushes):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        accepted += bool(client.push(model))
    return accepted


def shared_client_world(rank: int, threads: int = 4, pushes: int = 60) -> dict[str, Any]:
    """'0' is the primary, '0' and '1' secondaries; '1' pushes from ``threads`` threads through one accessor.

    The managed model takes plain SGD steps with lr 1 on gradients of ones, summed: its weights end at their
    initial values minus the number of applied pushes, whatever the order.
    """
    torch.set_num_threads(1)
    from pc_distributed import get_world

    world = get_world()
    assert world is not None
    group = world.create_rpc_group("g", ["0", "1"])
    impl = PushPullGradServerImpl(
        "gs", group, primary_reducer="0", secondary_reducers=["0", "1"], max_queue_size=4096
    )
    managed = ThreeLayer()
    if rank == 0:
        impl.manage_model(managed, PlainSGD(managed.parameters()))
    impl.start()
    group.barrier(WAIT)
    out: dict[str, Any] = {}
    if rank == 1:
        client = group.get_paired("gs").to_here()
        out["accepted"] = sum(hammer(threads, lambda _i: push_ones(client, pushes)))
        out["client"] = client.client_id
    group.barrier(WAIT)
    impl.stop(WAIT)  # the secondaries drain and say done; the primary waits for them, then applies the rest
    group.barrier(WAIT)
    out["ledger"] = impl.ledger()
    if rank == 0:
        out["weights"] = managed.weights()
    group.barrier(WAIT)
    return out


def merged(results: list[dict[str, Any]]) -> GradLedger:
    """The merged ledger of every rank's reducers."""
    return GradLedger.merge(r["ledger"] for r in results)
