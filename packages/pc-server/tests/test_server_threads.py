"""Thread safety of pc-server's public classes: several threads hammer one object, an invariant checks it.

The gradient server's invariant: every push that returned ``True`` is applied exactly once (the ledger books
no duplicates and balances), and the managed model equals the serial result of the accepted pushes (plain SGD
with lr 1 on gradients of ones, summed, so the order does not matter).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from server_fakegroup import Hub
from server_models import PlainSGD, ThreeLayer
from server_threads import hammer, merged, push_ones, shared_client_world

from pc_server import GradLedger, PushPullGradServerImpl

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
