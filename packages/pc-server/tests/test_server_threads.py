"""Thread safety of pc-server's public classes: several threads hammer one object, an invariant checks it.

The gradient server's invariant: every push that returned ``True`` is applied exactly once (the ledger books
no duplicates and balances), and the managed model equals the serial result of the accepted pushes (plain SGD
with lr 1 on gradients of ones, summed, so the order does not matter).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from server_fakegroup import Hub
from server_models import PlainSGD, ThreeLayer
from server_threads import hammer, merged, push_ones, shared_client_world

from pc_server import GradLedger, OrderedServerSimpleImpl, PushPullGradServerImpl, PushPullModelServerImpl

WAIT = 60.0


@pytest.fixture
def impls() -> Iterator[list[PushPullGradServerImpl]]:
    created: list[PushPullGradServerImpl] = []
    yield created
    for impl in reversed(created):
        impl.stop(timeout=WAIT)


def _tree(hub: Hub, impls: list[PushPullGradServerImpl], **kw: Any) -> ThreeLayer:
    """Primary '0' (a secondary too) and secondary '1'; summed plain SGD with lr 1."""
    managed = ThreeLayer()
    for name in ("0", "1"):
        impl = PushPullGradServerImpl(
            "gs", hub.group(name), secondary_reducers=["0", "1"], max_queue_size=4096, **kw
        )
        if name == "0":
            impl.manage_model(managed, PlainSGD(managed.parameters()))
        impls.append(impl)
    for impl in impls:
        impl.start()
    return managed


def test_one_grad_client_shared_by_four_threads_applies_every_accepted_push_once(
    impls: list[PushPullGradServerImpl],
) -> None:
    hub = Hub(["0", "1", "2"])
    managed = _tree(hub, impls, reduce_batch_size=4, flush_timeout=None)
    client = hub.group("2").get_paired("gs").to_here()
    threads, pushes = 4, 150
    accepted = sum(hammer(threads, lambda _i: push_ones(client, pushes)))
    for impl in reversed(impls):  # the secondary first, then the primary
        impl.stop(timeout=WAIT)
    ledger = GradLedger.merge(impl.ledger() for impl in impls)
    mine = ledger.clients[client.client_id]
    assert accepted == threads * pushes
    assert (mine.accepted, mine.applied, mine.duplicates, mine.dropped) == (accepted, accepted, 0, 0)
    assert ledger.balanced()
    assert managed.weights() == (1.0 - accepted, 2.0 - accepted, 3.0 - accepted)


@pytest.mark.slow
def test_one_grad_client_shared_by_four_threads_over_rpc() -> None:
    pc_distributed = pytest.importorskip("pc_distributed")
    results = pc_distributed.run_world(shared_client_world, 2, timeout=170, rpc_timeout=30, dist_timeout=30)
    accepted = results[1]["accepted"]
    ledger = merged(results)
    mine = ledger.clients[results[1]["client"]]
    assert accepted == 4 * 60
    assert (mine.accepted, mine.applied, mine.duplicates, mine.dropped) == (accepted, accepted, 0, 0)
    assert ledger.balanced()
    assert results[0]["weights"] == (1.0 - accepted, 2.0 - accepted, 3.0 - accepted)


def test_a_gradient_server_hammered_by_pushes_reads_and_concurrent_stops_loses_nothing(
    impls: list[PushPullGradServerImpl],
) -> None:
    """Two clients on two threads each push while a thread reads checkpoints; then three threads stop it."""
    hub = Hub(["0", "1", "2", "3"])
    managed = _tree(hub, impls, reduce_batch_size=2, flush_timeout=0.01)
    clients = [hub.group(n).get_paired("gs").to_here() for n in ("2", "3")]
    primary = impls[0]
    pushes = 40
    done = threading.Event()

    def work(i: int) -> int:
        if i < 4:
            try:
                return push_ones(clients[i % 2], pushes)
            finally:
                if i == 0:
                    done.set()
        reads = 0
        while not done.is_set() or reads == 0:
            state = primary.state_dict()  # of one step: the version, the steps and the applied counts agree
            assert state["primary"]["steps"] == state["primary"]["version"]
            ledger = primary.ledger()
            assert ledger.total.accepted == sum(c.accepted for c in ledger.clients.values())
            reads += 1
        return 0

    accepted = sum(hammer(5, work))
    hammer(3, lambda i: [impl.stop(timeout=WAIT) for impl in reversed(impls)])
    ledger = GradLedger.merge(impl.ledger() for impl in impls)
    assert accepted == 4 * pushes
    assert (ledger.total.accepted, ledger.total.applied, ledger.total.duplicates) == (accepted, accepted, 0)
    assert ledger.balanced()
    assert managed.weights() == (1.0 - accepted, 2.0 - accepted, 3.0 - accepted)


def test_an_ordered_server_accessor_shared_by_threads_keeps_every_cas_increment(hub3: Hub) -> None:
    """Threads increment one counter by compare-and-set through one remote and one in-process accessor."""
    impl = OrderedServerSimpleImpl("kv", hub3.group("0"))
    remote = hub3.group("1").get_paired("kv").to_here()
    local = impl.accessor()
    assert remote.push("n", 0, 0, None)
    per_thread = 30

    def increment(i: int) -> int:
        server = remote if i % 2 else local
        tries = 0
        for _ in range(per_thread):
            while True:
                tries += 1
                found = server.pull("n")
                assert found is not None
                value, version = found
                if server.push("n", value + 1, version + 1, version):
                    break
        return tries

    hammer(4, increment)
    assert remote.pull("n") == (4 * per_thread, 4 * per_thread)  # every accepted push moved it by one
    assert impl.state_dict()["entries"]["n"] == [(4 * per_thread, 4 * per_thread)]


def test_a_model_server_accessor_shared_by_threads_keeps_every_accepted_push(hub3: Hub) -> None:
    """Each thread adds 1 to its own model and pushes it (pulling on refusal): weights == 1 + version."""
    PushPullModelServerImpl("ms", hub3.group("0"))
    server = hub3.group("1").get_paired("ms").to_here()
    assert server.push(ThreeLayer())  # version 1
    per_thread = 15

    def bump(_i: int) -> None:
        model = ThreeLayer()
        assert server.pull(model)
        for _ in range(per_thread):
            while True:
                with torch.no_grad():
                    for p in model.parameters():
                        p += 1
                if server.push(model):  # refused: the newest model and version were loaded
                    break

    hammer(4, bump)
    final = ThreeLayer()
    assert server.pull(final)
    n = 4 * per_thread
    assert final.pp_version == 1 + n
    assert final.weights() == (1.0 + n, 2.0 + n, 3.0 + n)
