"""Issue 14: every gradient accounted for, in every reducer topology (in-process grid + named regressions).

The multi-process half (the reported 3-process world and a few generated cases) is in
test_server_topology_world.py.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest
import torch
from server_fakegroup import Hub
from server_grid import (
    REGRESSION,
    Case,
    OneHot,
    RecordingSGD,
    check_case,
    generate_cases,
    run_case_in_process,
)
from server_models import PlainSGD, ThreeLayer

from pc_server import GradLedger, PushPullGradServerImpl

WAIT = 30.0
REDUCERS = ["p", "s1", "s2", "s3"]
CLIENTS = ["c1", "c2", "c3"]
GRID = generate_cases(seed=14, count=48, reducers=REDUCERS, clients=CLIENTS)


def test_grid_covers_the_space() -> None:
    """The seeded generator reaches every axis of the grid (so the cases below mean what they claim)."""
    assert {c.primary in c.secondaries for c in GRID} == {True, False}
    assert {len(c.secondaries) for c in GRID} == {1, 2, 3}
    assert {len(c.clients) for c in GRID} == {1, 2, 3}
    assert {c.batch for c in GRID} == {1, 2, 3, 4}
    assert {c.method for c in GRID} == {"sum", "mean"}
    assert {c.max_staleness for c in GRID} == {None, 0, 1}
    assert {c.flush_timeout for c in GRID} == {None, 0.05}
    assert any(c.size % c.batch for c in GRID)  # partial batches: the flush path
    assert any(c.stale_pushes for c in GRID)


@pytest.mark.parametrize("case", GRID, ids=[c.name for c in GRID])
def test_grid_every_accepted_push_applied_once_or_booked(case: Case) -> None:
    hub = Hub([*REDUCERS, *CLIENTS])
    check_case(case, run_case_in_process(case, hub))


def _regression_hub(
    flush_timeout: float | None = 0.05,
) -> tuple[Hub, dict[str, PushPullGradServerImpl], ThreeLayer]:
    hub = Hub(["0", "1", "2"])
    impls = {}
    model = ThreeLayer()
    for name in ("0", "1"):
        impl = PushPullGradServerImpl(
            REGRESSION.name,
            hub.group(name),  # type: ignore[arg-type]
            primary_reducer="0",
            secondary_reducers=["0", "1"],
            reduce_method="sum",
            reduce_batch_size=2,
            flush_timeout=flush_timeout,
        )
        if name == "0":
            impl.manage_model(model, PlainSGD(model.parameters()))
        impl.start()
        impls[name] = impl
    return hub, impls, model


def _push_same_grads(client: object, times: int) -> list[bool]:
    model = ThreeLayer()
    out = []
    for _ in range(times):
        for p, g in zip(model.parameters(), (6.0, 3.0, 2.0), strict=True):
            p.grad = torch.full_like(p, g)
        out.append(client.push(model))  # type: ignore[attr-defined]
    return out


def test_issue14_seven_pushes_two_reducers_none_lost_while_reducer_directories_stall() -> None:
    """The reported topology, with the reducers' service directories unusable (their main threads parked in
    ``RpcGroup.barrier()``): forwards must not need a directory look-up, and all 7 pushes are applied."""
    hub, impls, model = _regression_hub()
    hub.stalled_directory.update({"0", "1"})
    client = hub.group("2").get_paired(REGRESSION.name).to_here()
    assert _push_same_grads(client, 7) == [True] * 7
    primary = impls["0"]
    for _ in range(7):  # bounded: at most one step per push
        if primary.ledger().total.applied == 7:
            break
        primary.wait_for_version(primary.stats().version + 1, WAIT)
    primary.watch()
    impls["1"].watch()
    assert model.weights() == (1.0 - 42.0, 2.0 - 21.0, 3.0 - 14.0)  # w0 - 7g, before anything stopped
    assert any(c.endswith("@0") for c in hub.calls)  # '1' forwarded by member name, not by directory
    hub.stalled_directory.clear()
    impls["1"].stop(timeout=WAIT)
    primary.stop(timeout=WAIT)
    ledger = client.ledger()
    assert ledger.balanced()
    assert ledger.clients[client.client_id].accepted == ledger.clients[client.client_id].applied == 7


def test_issue14_primary_stopped_first_books_dropped_at_shutdown(caplog: pytest.LogCaptureFixture) -> None:
    """Stopping the primary before a secondary loses that secondary's bundle: never silently."""
    hub, impls, model = _regression_hub(flush_timeout=None)  # partial batches wait for stop()
    client = hub.group("2").get_paired(REGRESSION.name).to_here()
    client.set_seed(1)  # start on '1'
    assert client.next_secondary() == "1"
    assert _push_same_grads(client, 2) == [True] * 2  # '1' and '0' hold one each
    # the wrong order, without waiting for '1': the primary first (it drains its own secondary)
    impls["0"].stop(timeout=WAIT, secondaries_timeout=0)
    with caplog.at_level(logging.WARNING, logger="pc_server"):
        impls["1"].stop(timeout=WAIT)
    assert "dropping a final bundle of 1 pushes" in caplog.text
    ledger = GradLedger.merge(impl.ledger() for impl in impls.values())
    assert ledger.balanced()
    assert (ledger.total.accepted, ledger.total.applied, ledger.total.dropped_shutdown) == (2, 1, 1)
    assert ledger.clients[client.client_id].dropped_shutdown == 1
    assert model.weights() == (1.0 - 6.0, 2.0 - 3.0, 3.0 - 2.0)


def test_issue14_lost_reply_is_retried_and_applied_exactly_once() -> None:
    """A transport error after the secondary received the push: the client retries with the same seq and
    the secondary's (client, seq) table answers without queueing it again."""
    hub, impls, model = _regression_hub()
    client = hub.group("2").get_paired(REGRESSION.name).to_here()
    client.set_seed(1)
    target = client.next_secondary()
    hub.lose_reply.add(f"{REGRESSION.name}/{target}/_push_service")
    assert _push_same_grads(client, 1) == [True]  # the reply was lost once; the retry said "accepted"
    assert not hub.lose_reply  # the failure did fire
    impls["1"].stop(timeout=WAIT)
    impls["0"].stop(timeout=WAIT)
    ledger = client.ledger()
    mine = ledger.clients[client.client_id]
    assert (mine.accepted, mine.duplicates, mine.applied) == (1, 1, 1)
    assert ledger.balanced()
    assert model.weights() == (1.0 - 6.0, 2.0 - 3.0, 3.0 - 2.0)  # applied once, not twice


def test_queue_overflow_and_reducer_failure_are_booked() -> None:
    """Overflowed and failed-reducer pushes land in the ledger; it still balances."""
    hub = Hub(["p", "c1"])

    class Exploding(RecordingSGD):
        def step(self) -> None:
            raise FloatingPointError("boom")

    impl = PushPullGradServerImpl(
        "ovf",
        hub.group("p"),  # type: ignore[arg-type]
        primary_reducer="p",
        secondary_reducers=["p"],
        reduce_batch_size=1,
        max_queue_size=2,
        flush_timeout=None,
    )
    model = OneHot(8)
    impl.manage_model(model, Exploding(model.parameters()))
    client = hub.group("c1").get_paired("ovf").to_here()
    pushes = OneHot(8)
    for i in range(3):  # not started: the third push overflows the queue of 2
        pushes.w.grad = torch.eye(8, dtype=torch.float64)[i]
        assert client.push(pushes) is True
    impl.start()
    assert impl.wait_for_version(1, WAIT) is False  # the step explodes
    with pytest.raises(FloatingPointError):
        impl.watch()
    impl.stop(timeout=WAIT)
    ledger = impl.ledger()
    assert ledger.total.accepted == 3
    assert ledger.total.dropped_overflow == 1
    assert ledger.total.dropped_error == 2
    assert ledger.balanced()


def test_secondary_built_and_started_before_its_primary_still_forwards() -> None:
    """No look-up happens at construction or start: a secondary may come up before its primary exists."""
    case = Case(
        name="late_primary",
        primary="p",
        secondaries=("s1",),
        clients=("c1",),
        pushes=(3,),
        batch=2,
        method="sum",
        max_staleness=None,
        flush_timeout=None,
        build_order=("s1", "p"),
    )
    check_case(case, run_case_in_process(case, Hub(["p", "s1", "c1"])))


def test_primary_stop_waits_for_the_other_secondaries_so_concurrent_stops_lose_nothing() -> None:
    """Every reducer calls stop() concurrently (as ServerTuple.stop in each process does): the primary waits
    for the other secondary's final message, so its partial batch is applied, not dropped."""
    hub, impls, model = _regression_hub(flush_timeout=None)  # partial batches wait for stop()
    client = hub.group("2").get_paired(REGRESSION.name).to_here()
    client.set_seed(1)
    assert _push_same_grads(client, 2) == [True] * 2  # '1' and '0' hold a partial batch each
    primary_stop = threading.Thread(target=impls["0"].stop, kwargs={"timeout": WAIT})
    primary_stop.start()  # the primary's stop() first: it must wait for '1'
    primary_stop.join(0.2)
    assert (
        primary_stop.is_alive()
    )  # waiting for the secondary's final message (bounded by secondaries_timeout)
    impls["1"].stop(timeout=WAIT)
    primary_stop.join(WAIT)
    assert not primary_stop.is_alive()
    ledger = client.ledger()
    assert ledger.balanced()
    assert (ledger.total.accepted, ledger.total.applied, ledger.total.dropped) == (2, 2, 0)
    assert model.weights() == (1.0 - 12.0, 2.0 - 6.0, 3.0 - 4.0)


def test_pushes_queued_on_a_never_started_secondary_are_booked(caplog: pytest.LogCaptureFixture) -> None:
    hub = Hub(["p", "s", "c"])
    primary = PushPullGradServerImpl("ns", hub.group("p"), primary_reducer="p", secondary_reducers=["s"])  # type: ignore[arg-type]
    secondary = PushPullGradServerImpl("ns", hub.group("s"), primary_reducer="p", secondary_reducers=["s"])  # type: ignore[arg-type]
    model = OneHot(2)
    primary.manage_model(model, RecordingSGD(model.parameters()))
    primary.start()
    client = hub.group("c").get_paired("ns").to_here()
    pushes = OneHot(2)
    pushes.w.grad = torch.ones(2, dtype=torch.float64)
    assert client.push(pushes) is True  # queued on "s", whose reducer never runs
    with caplog.at_level(logging.WARNING, logger="pc_server"):
        secondary.stop(timeout=WAIT)
    assert "never started" in caplog.text
    primary.stop(timeout=WAIT)
    ledger = client.ledger()
    assert ledger.balanced()
    assert (ledger.total.accepted, ledger.total.dropped_shutdown, ledger.total.applied) == (1, 1, 0)


def test_colocated_forward_is_a_direct_call_and_the_config_is_frozen() -> None:
    hub = Hub(["0", "1"])
    impl = PushPullGradServerImpl(
        "co",
        hub.group("0"),  # type: ignore[arg-type]
        secondary_reducers=["0"],
        reduce_batch_size=1,
        flush_timeout=None,
    )
    model = ThreeLayer()
    impl.manage_model(model, PlainSGD(model.parameters()))
    impl.start()
    client = hub.group("1").get_paired("co").to_here()
    assert _push_same_grads(client, 2) == [True, True]
    assert impl.wait_for_version(2, WAIT)
    impl.stop(timeout=WAIT)
    assert not [c for c in hub.calls if c.startswith("rpc_sync")]  # no RPC from the reducer to itself
    assert hub.calls.count("co/0/_push_service") == 2  # the client's two pushes, nothing else
    with pytest.raises(dataclasses.FrozenInstanceError):
        impl.config.reduce_batch_size = 3  # type: ignore[misc]
    assert impl.config.is_primary
    assert impl.config.other_secondaries == frozenset()
