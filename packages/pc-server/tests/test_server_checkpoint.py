"""Issue 14 part 4 in process: the gradient server's state dict (restart, refusals, while running).

The ordered and model servers' are in test_server_checkpoint_simple.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from server_fakegroup import Hub
from server_models import ThreeLayer, through_disk

from pc_server import (
    REDUCE_SLAVE,
    GradLedger,
    PushPullGradServerImpl,
)
from pc_server._packing import pack
from pc_server.grad._protocol import GradMessage, reducer_service_name

WAIT = 20.0


# ------------------------------------------------------------------------------------------------ grad server
@pytest.fixture
def impls() -> Iterator[list[PushPullGradServerImpl]]:
    created: list[PushPullGradServerImpl] = []
    yield created
    for impl in reversed(created):
        impl.stop(timeout=WAIT)


def _optim(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _build(hub: Hub, impls: list[PushPullGradServerImpl], model: torch.nn.Module, state: Any = None) -> Any:
    """Primary '0' (also a secondary) and secondary '1'; B=1 so that every push is one step."""
    built = []
    for name in ("0", "1"):
        impl = PushPullGradServerImpl(
            "gs", hub.group(name), secondary_reducers=["0", "1"], reduce_batch_size=1, flush_timeout=None
        )
        if name == "0":
            impl.manage_model(model, *_optim(model))
        if state is not None:
            impl.load_state_dict(state[name])
        impls.append(impl)
        built.append(impl)
    for impl in built:
        impl.start()
    return built


def _push_ones(client: Any, model: ThreeLayer, n: int) -> None:
    for _ in range(n):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        assert client.push(model) is True


def _serial(n: int) -> ThreeLayer:
    ref = ThreeLayer()
    opt, sched = _optim(ref)
    for _ in range(n):
        for p in ref.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        sched.step()
    return ref


def test_grad_server_restart_resumes_weights_optimizer_version_ledger_dedup(
    impls: list[PushPullGradServerImpl],
) -> None:
    hub = Hub(["0", "1", "2"])
    reducers = _build(hub, impls, ThreeLayer())
    client = hub.group("2").get_paired("gs").to_here()
    worker = ThreeLayer()
    _push_ones(client, worker, 4)
    last_target = client.secondary_reducers[(client._peek() - 1) % 2]  # where push 4 went
    assert reducers[0].wait_for_version(4, WAIT)
    for impl in reversed(reducers):
        impl.stop(timeout=WAIT)
    before = GradLedger.merge(r.ledger() for r in reducers)
    state = through_disk({"0": reducers[0].state_dict(), "1": reducers[1].state_dict()})
    assert state["0"]["primary"]["version"] == 4
    assert state["1"]["primary"] is None

    hub2 = Hub(["0", "1", "2"])
    managed = ThreeLayer()
    with torch.no_grad():
        managed.fc1.weight.fill_(-5.0)  # overwritten by the checkpoint
    restored = _build(hub2, impls, managed, state)
    assert restored[0].stats().version == 4
    assert managed.pp_version == 4
    assert managed.weights() == _serial(4).weights()
    assert restored[0].optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)
    assert GradLedger.merge(r.ledger() for r in restored) == before

    # the dedup table came back: the old client's last (client, seq) retried is a duplicate, not applied twice
    again = GradMessage(
        pack({n: torch.ones_like(p) for n, p in worker.named_parameters()}), client.client_id, 4, 4
    )
    reply = hub2.group("2").registered_sync(
        reducer_service_name("gs", last_target), args=(again, REDUCE_SLAVE)
    )
    assert reply[0] is True  # answered as the first time

    fresh = hub2.group("2").get_paired("gs").to_here()
    model = ThreeLayer()
    assert fresh.pull(model)
    assert model.pp_version == 4
    _push_ones(fresh, model, 3)
    assert restored[0].wait_for_version(7, WAIT)
    for impl in reversed(restored):
        impl.stop(timeout=WAIT)
    assert managed.weights() == pytest.approx(_serial(7).weights())
    after = GradLedger.merge(r.ledger() for r in restored)
    assert after.balanced()
    assert (after.total.accepted, after.total.applied, after.total.duplicates) == (7, 7, 1)
    assert after.clients[client.client_id].applied == 4
    assert after.clients[fresh.client_id].applied == 3


def test_grad_server_load_refusals_and_bad_input(impls: list[PushPullGradServerImpl]) -> None:
    hub = Hub(["0", "1", "2"])
    reducers = _build(hub, impls, ThreeLayer())
    good = {"0": reducers[0].state_dict(), "1": reducers[1].state_dict()}
    with pytest.raises(RuntimeError, match="must be called before start"):
        reducers[0].load_state_dict(good["0"])

    hub2 = Hub(["0", "1", "2"])
    primary = PushPullGradServerImpl("gs", hub2.group("0"), secondary_reducers=["0", "1"])
    impls.append(primary)
    with pytest.raises(RuntimeError, match="call manage_model"):
        primary.load_state_dict(good["0"])
    model = ThreeLayer()
    primary.manage_model(model, *_optim(model))
    secondary = PushPullGradServerImpl("gs", hub2.group("1"), secondary_reducers=["0", "1"])
    impls.append(secondary)
    with pytest.raises(ValueError, match="written by '0', a primary reducer, but '1' is not one"):
        secondary.load_state_dict(good["0"])
    with pytest.raises(ValueError, match="written by '1', not a primary reducer, but '0' is one"):
        primary.load_state_dict(good["1"])
    cases: list[tuple[Any, type, str]] = [
        ({**good["0"], "server_name": "other"}, ValueError, "server_name 'other', this server has 'gs'"),
        (good["0"]["primary"], ValueError, "written by None"),
        ({**good["0"], "ledger": {"total": {}, "clients": {}}}, ValueError, "ledger total must map"),
        (
            {**good["0"], "secondary": {"dedup": {"c": [-1, True]}, "head": 0}},
            ValueError,
            r"dedup\['c'\] seq must be an int >= 0",
        ),
        (
            {**good["0"], "primary": {**good["0"]["primary"], "model": {"fc9.weight": torch.ones(1, 1)}}},
            ValueError,
            "model state does not fit the managed model",
        ),
        (
            {**good["0"], "primary": {**good["0"]["primary"], "lr_scheduler": None}},
            ValueError,
            "holds no lr_scheduler state but the managed lr_scheduler has one",
        ),
        (
            {**good["0"], "primary": {**good["0"]["primary"], "version": -3}},
            ValueError,
            "primary version must be an int >= 0",
        ),
    ]
    for state, error, match in cases:
        with pytest.raises(error, match=match):
            primary.load_state_dict(state)
    assert model.weights() == (1.0, 2.0, 3.0)
    assert primary.stats().version == 0


def test_grad_checkpoint_while_running_is_one_steps_worth(impls: list[PushPullGradServerImpl]) -> None:
    """Checkpoints taken while pushes are applied: model, version, steps and applied counts always agree."""
    from server_models import PlainSGD

    hub = Hub(["0", "1"])
    impl = PushPullGradServerImpl(
        "gs",
        hub.group("0"),
        secondary_reducers=["0"],
        reduce_batch_size=1,
        max_queue_size=1024,
        flush_timeout=None,
    )
    managed = ThreeLayer()
    impl.manage_model(managed, PlainSGD(managed.parameters()))
    impl.start()
    impls.append(impl)
    client = hub.group("1").get_paired("gs").to_here()
    pushes = 150
    errors: list[BaseException] = []

    def push_all() -> None:
        try:
            _push_ones(client, ThreeLayer(), pushes)
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=push_all)
    worker.start()
    seen = set()
    while worker.is_alive() or impl.stats().version < pushes:
        state = impl.state_dict()
        primary = state["primary"]
        version = primary["version"]
        assert primary["steps"] == version == state["ledger"]["total"]["applied"]
        assert primary["model"]["fc1.weight"].item() == 1.0 - version  # gradient 1, lr 1: one step each
        seen.add(version)
        if not worker.is_alive() and not impl.wait_for_version(pushes, WAIT):
            break
    worker.join(WAIT)
    assert not errors
    assert impl.stats().version == pushes
    assert len(seen) > 1  # checkpoints really were taken between steps


def _co_located(hub: Hub, impls: list[PushPullGradServerImpl], state: Any = None) -> Any:
    """Primary '0', its own only secondary; B=2 at both levels, so pushes wait in both queues."""
    from server_models import PlainSGD

    impl = PushPullGradServerImpl(
        "gs", hub.group("0"), secondary_reducers=["0"], reduce_batch_size=2, flush_timeout=None
    )
    impls.append(impl)
    managed = ThreeLayer()
    impl.manage_model(managed, PlainSGD(managed.parameters()))
    if state is not None:
        impl.load_state_dict(state)
    impl.start()
    return impl, managed


def test_grad_checkpoint_while_running_keeps_the_queued_pushes(impls: list[PushPullGradServerImpl]) -> None:
    """A checkpoint with pushes queued at both levels: restored, they are applied; the ledger balances."""
    hub = Hub(["0", "1"])
    impl, _managed = _co_located(hub, impls)
    client = hub.group("1").get_paired("gs").to_here()
    _push_ones(client, ThreeLayer(), 7)
    # pushes 1-4 are one step (version 1); the bundle of 5-6 waits in the primary's queue for a second bundle,
    # push 7 in the secondary's queue for a second push (no flush timeout): take checkpoints until it is so
    deadline = time.monotonic() + WAIT
    state = impl.state_dict()
    while time.monotonic() < deadline and not (
        state["primary"]["version"] == 1 and state["primary"]["pending"] and state["secondary"]["pending"]
    ):
        impl.wait_for_version(1, WAIT)
        state = impl.state_dict()
    assert state["primary"]["version"] == 1
    assert [sum(p[1] for p in bundle.values()) for bundle in state["primary"]["pending"]] == [2]
    assert len(state["secondary"]["pending"]) == 1
    assert state["ledger"]["total"]["accepted"] == 7
    assert state["ledger"]["total"]["applied"] == 4
    impl.stop(timeout=WAIT)  # the running server applies them too; the checkpoint is of the moment before

    restored, managed = _co_located(Hub(["0", "1"]), impls, through_disk(state))
    assert managed.weights() == (-3.0, -2.0, -1.0)  # version 1: the sum of 4 pushes of ones, lr 1
    restored.stop(timeout=WAIT)  # drains: the restored pushes are applied, none twice
    ledger = restored.ledger()
    assert ledger.balanced()
    assert (ledger.total.accepted, ledger.total.applied) == (7, 7)
    assert ledger.clients[client.client_id].applied == 7
    assert managed.weights() == (-6.0, -5.0, -4.0)  # every push applied exactly once


def test_grad_checkpoint_pending_entries_are_validated(impls: list[PushPullGradServerImpl]) -> None:
    from server_models import PlainSGD

    good = _co_located(Hub(["0", "1"]), impls)[0].state_dict()
    hub = Hub(["0", "1"])
    cases: list[tuple[str, Any, str]] = [
        ("secondary", [[0, "not packed", "c"]], r"secondary pending\[0\] must be \[version, packed"),
        ("primary", [{0: [None, 1, {"c": 1}]}], r"primary pending\[0\]\[0\] must be \[packed gradients"),
    ]
    for role, pending, match in cases:
        impl = PushPullGradServerImpl("gs", hub.group("0"), secondary_reducers=["0"])
        impls.append(impl)
        model = ThreeLayer()
        impl.manage_model(model, PlainSGD(model.parameters()))
        with pytest.raises(ValueError, match=match):
            impl.load_state_dict({**good, role: {**good[role], "pending": pending}})
        hub = Hub(["0", "1"])
    # a primary part that does not fit leaves the secondary's part unloaded: nothing queued twice on a retry
    impl = PushPullGradServerImpl("gs", hub.group("0"), secondary_reducers=["0"])
    impls.append(impl)
    model = ThreeLayer()
    impl.manage_model(model, PlainSGD(model.parameters()))
    push = [0, pack({n: torch.ones_like(p) for n, p in model.named_parameters()}), "c"]
    one = {**dict.fromkeys(good["ledger"]["total"], 0), "accepted": 1}
    held = {
        **good,
        "secondary": {**good["secondary"], "pending": [push]},
        "ledger": {"total": one, "clients": {"c": one}},
    }
    bad_model = {**good["primary"], "model": {"fc9.weight": torch.ones(1, 1)}}
    with pytest.raises(ValueError, match="model state does not fit"):
        impl.load_state_dict({**held, "primary": bad_model})
    assert impl.state_dict()["secondary"]["pending"] == []
    # a ledger that does not account for the held push is refused too
    with pytest.raises(ValueError, match="holds 1 pushes of client 'c' but its ledger counts 0 pending"):
        impl.load_state_dict({**held, "ledger": good["ledger"]})
    impl.load_state_dict(held)
    assert len(impl.state_dict()["secondary"]["pending"]) == 1


def test_clients_of_a_dead_primary_get_an_error_naming_it_and_nothing_is_silent(
    impls: list[PushPullGradServerImpl],
) -> None:
    from server_models import PlainSGD, backward_once

    hub = Hub(["0", "1", "2"])
    kw: dict[str, Any] = {"secondary_reducers": ["1"], "reduce_batch_size": 1, "flush_timeout": None}
    primary = PushPullGradServerImpl("gs", hub.group("0"), **kw)
    managed = ThreeLayer()
    primary.manage_model(managed, PlainSGD(managed.parameters()))
    secondary = PushPullGradServerImpl("gs", hub.group("1"), **kw)
    impls.extend([primary, secondary])
    for impl in (primary, secondary):
        impl.start()
    client = hub.group("2").get_paired("gs").to_here()
    hub.dead.add("0")  # the primary's process is gone
    model = ThreeLayer()
    backward_once(model)
    # the live secondary queues the push; the pull that ends push() names the dead ordered server
    with pytest.raises(ConnectionError, match="'gs_o_server'"):
        client.push(model)
    secondary.stop(timeout=WAIT)
    mine = secondary.ledger().clients[client.client_id]
    assert (mine.accepted, mine.applied) == (1, 0)
    assert mine.dropped_error + mine.dropped_shutdown == 1  # its forward failed: booked, never silent
    with pytest.raises(ConnectionError, match="'gs'"):
        client.ledger()  # asks the dead primary too
    primary.stop(timeout=WAIT, secondaries_timeout=0)  # its secondary could not say it is done
