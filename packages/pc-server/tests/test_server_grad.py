"""The gradient server's reduction tree through the fake in-process group (real threads, no RPC)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from server_fakegroup import Hub
from server_models import PlainSGD, ThreeLayer, backward_once

from pc_server import (
    REDUCE_SLAVE,
    GradServerConfig,
    PushPullGradServer,
    PushPullGradServerImpl,
    ReducerStoppedError,
    ReducerTraceback,
)
from pc_server._packing import pack
from pc_server.grad._protocol import (
    Forward,
    GradMessage,
    forward_service_name,
    ledger_service_name,
    reducer_service_name,
)

WAIT = 20.0


@pytest.fixture
def impls() -> Iterator[list[PushPullGradServerImpl]]:
    created: list[PushPullGradServerImpl] = []
    yield created
    for impl in reversed(created):  # secondaries first, the primary ("0", built first) last
        impl.stop(timeout=WAIT)


def _tree(hub: Hub, impls: list[PushPullGradServerImpl], secondaries: list[str], **kw: object) -> ThreeLayer:
    model = ThreeLayer()
    for name in sorted({"0", *secondaries}):
        impl = PushPullGradServerImpl("server", hub.group(name), secondary_reducers=secondaries, **kw)  # type: ignore[arg-type]
        if name == "0":
            impl.manage_model(model, PlainSGD(model.parameters()))
        impl.start()
        impls.append(impl)
    return model


@pytest.mark.parametrize(("method", "expected"), [("sum", (-23.0, -10.0, -5.0)), ("mean", (-5.0, -1.0, 1.0))])
def test_machin_example(hub3: Hub, impls: list[PushPullGradServerImpl], method: str, expected: tuple) -> None:
    managed = _tree(hub3, impls, ["0"], reduce_method=method, reduce_batch_size=2, flush_timeout=None)
    params = [id(p) for p in managed.parameters()]
    clients = [hub3.group(n).get_paired("server").to_here() for n in ("1", "2")]
    models = [ThreeLayer(), ThreeLayer()]
    for _ in range(2):
        for client, model in zip(clients, models, strict=True):
            backward_once(model)
            model.pp_version = 0
            assert client.push(model) is True
            assert all(p.grad is None for p in model.parameters())
    primary = impls[0]
    assert primary.wait_for_version(1, WAIT), primary.stats()
    primary.watch()
    final = ThreeLayer()
    assert clients[0].pull(final)
    assert final.weights() == expected
    assert final.pp_version == 1
    assert managed.weights() == expected
    assert [id(p) for p in managed.parameters()] == params
    stats = primary.stats()
    assert (stats.received, stats.forwarded, stats.steps, stats.applied) == (4, 2, 1, 4)


def test_every_secondary_reduces_and_rotation_is_seedable(
    hub3: Hub, impls: list[PushPullGradServerImpl]
) -> None:
    _tree(hub3, impls, ["0", "1", "2"], reduce_method="sum", reduce_batch_size=1, flush_timeout=None)
    client = hub3.group("1").get_paired("server").to_here()
    assert isinstance(client, PushPullGradServer)
    client.set_seed(7)
    first = client.next_secondary()
    seen = []
    model = ThreeLayer()
    for _ in range(3):
        seen.append(client.next_secondary())
        backward_once(model)
        model.pp_version = 0
        client.push(model)
    assert seen[0] == first
    assert sorted(seen) == ["0", "1", "2"]
    assert impls[0].wait_for_version(3, WAIT)
    assert [impl.stats().received for impl in impls] == [1, 1, 1]
    other = hub3.group("2").get_paired("server").to_here()
    other.set_seed(7)
    assert other.next_secondary() == first


def test_partial_batch_flush_mean_weighted(hub3: Hub, impls: list[PushPullGradServerImpl]) -> None:
    managed = _tree(hub3, impls, ["0"], reduce_method="mean", reduce_batch_size=4, flush_timeout=0.2)
    client = hub3.group("1").get_paired("server").to_here()
    for scale in (1.0, 2.0, 6.0):
        model = ThreeLayer()
        model.pp_version = 0
        backward_once(model)
        for p in model.parameters():
            p.grad.mul_(scale)  # type: ignore[union-attr]
        client.push(model)
    assert impls[0].wait_for_version(1, WAIT)
    assert impls[0].stats().applied == 3
    # mean of scales is 3: weights - 3 * (6, 3, 2)
    assert managed.weights() == (1.0 - 18.0, 2.0 - 9.0, 3.0 - 6.0)


def test_staleness_bound_drops_and_counts(hub3: Hub, impls: list[PushPullGradServerImpl]) -> None:
    _tree(hub3, impls, ["0"], reduce_batch_size=1, flush_timeout=None, max_staleness=0)
    client = hub3.group("1").get_paired("server").to_here()
    model = ThreeLayer()
    model.pp_version = 0
    backward_once(model)
    assert client.push(model) is True
    assert impls[0].wait_for_version(1, WAIT)
    # the secondary learns the head from the primary's reply to its forward
    stale = ThreeLayer()
    stale.pp_version = 0
    backward_once(stale)
    assert client.push(stale) is False
    assert impls[0].stats().dropped_stale == 1
    assert stale.pp_version == 1  # it pulled the newest model anyway
    backward_once(stale)
    assert client.push(stale) is True
    assert impls[0].wait_for_version(2, WAIT)


def test_primary_rechecks_staleness_exactly(hub3: Hub, impls: list[PushPullGradServerImpl]) -> None:
    _tree(hub3, impls, ["1"], reduce_batch_size=1, flush_timeout=None, max_staleness=0)
    primary, secondary = impls
    client = hub3.group("2").get_paired("server").to_here()
    model = ThreeLayer()
    model.pp_version = 0
    backward_once(model)
    client.push(model)
    assert primary.wait_for_version(1, WAIT)
    stale = ThreeLayer()
    stale.pp_version = 0
    backward_once(stale)
    client.push(stale)  # the secondary may not know version 1 yet: the primary must drop it
    fresh = ThreeLayer()
    fresh.pp_version = 1
    backward_once(fresh)
    client.push(fresh)
    assert primary.wait_for_version(2, WAIT)
    assert primary.stats().steps == 2
    assert primary.stats().dropped_stale + secondary.stats().dropped_stale == 1


def test_lr_scheduler_steps(hub3: Hub, impls: list[PushPullGradServerImpl]) -> None:
    model = ThreeLayer()
    primary = PushPullGradServerImpl(
        "server", hub3.group("0"), secondary_reducers=["0"], reduce_batch_size=1, flush_timeout=None
    )
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    primary.manage_model(model, opt, sched)
    primary.start()
    impls.append(primary)
    client = hub3.group("1").get_paired("server").to_here()
    c = ThreeLayer()
    for i in range(2):
        backward_once(c)
        client.push(c)
        assert primary.wait_for_version(i + 1, WAIT)
    # step 1 at lr 1, step 2 at lr 0.5 on the gradient of the stale client weights (6, 3, 2) then new ones
    assert opt.param_groups[0]["lr"] == 0.25
    assert sched.last_epoch == 2


def test_reducer_error_surfaces_in_watch_and_stops_pushes(
    hub3: Hub, impls: list[PushPullGradServerImpl]
) -> None:
    class Exploding:
        def step(self) -> None:
            raise FloatingPointError("boom in step")

    model = ThreeLayer()
    primary = PushPullGradServerImpl(
        "server", hub3.group("0"), secondary_reducers=["0"], reduce_batch_size=1, flush_timeout=None
    )
    primary.manage_model(model, Exploding())
    primary.start()
    impls.append(primary)
    client = hub3.group("1").get_paired("server").to_here()
    c = ThreeLayer()
    backward_once(c)
    client.push(c)
    assert primary.wait_for_version(1, WAIT) is False
    with pytest.raises(FloatingPointError, match="boom in step") as info:
        primary.watch()
    assert isinstance(info.value.__cause__, ReducerTraceback)
    assert "Exploding" in str(info.value.__cause__) or "step" in str(info.value.__cause__)
    backward_once(c)
    with pytest.raises(ReducerStoppedError, match="failed"):
        client.push(c)


def test_duplicates_ignored_and_schema_checked(hub3: Hub, impls: list[PushPullGradServerImpl]) -> None:
    _tree(hub3, impls, ["0"], reduce_batch_size=8, flush_timeout=None)
    service = impls[0]._push_service
    grads = pack(
        {"fc1.weight": torch.ones(1, 1), "fc2.weight": torch.ones(1, 1), "fc3.weight": torch.ones(1, 1)}
    )
    msg = GradMessage(grads, "c", 1, 0)
    assert service(msg, REDUCE_SLAVE) == (True, 0)
    assert service(msg, REDUCE_SLAVE) == (True, 0)  # a retry is answered as the first time, not queued again
    newer = GradMessage(grads, "c", 2, 0)
    assert service(newer, REDUCE_SLAVE) == (True, 0)
    assert service(msg, REDUCE_SLAVE) == (False, 0)  # an older seq: refused
    assert impls[0].stats().duplicates == 2
    assert impls[0].stats().received == 2
    assert impls[0].ledger().clients["c"].accepted == 2
    bad = GradMessage(pack({"fc1.weight": torch.ones(2)}), "c", 3, 0)
    with pytest.raises(ValueError, match="differ from the first push"):
        service(bad, REDUCE_SLAVE)
    with pytest.raises(TypeError, match="GradMessage"):
        service({"x": 1}, REDUCE_SLAVE)
    with pytest.raises(ValueError, match="unknown push level 7"):
        service(msg, 7)


def test_one_service_per_message_kind(hub3: Hub, impls: list[PushPullGradServerImpl]) -> None:
    """Pushes, forwards and ledger requests each have a service of their own, on the right members."""
    managed = _tree(hub3, impls, ["1"], reduce_batch_size=1, flush_timeout=None)  # "0" is the primary only
    services = {key: owner for key, (owner, _fn) in hub3.services.items() if key.startswith("server/")}
    assert services == {
        reducer_service_name("server", "1"): "1",
        forward_service_name("server", "0"): "0",
        ledger_service_name("server", "0"): "0",
        ledger_service_name("server", "1"): "1",
    }
    ones = pack({n: torch.ones_like(p) for n, p in managed.named_parameters()})
    caller = hub3.group("2")
    # a forward: the primary steps on it (lr 1: every weight goes down by one)
    before = managed.weights()
    head = caller.registered_sync(
        forward_service_name("server", "0"), args=(Forward({0: (ones, 1, {"c": 1})}), 0.0)
    )
    assert head == 0
    assert impls[0].wait_for_version(1, WAIT)
    assert managed.weights() == tuple(w - 1.0 for w in before)
    with pytest.raises(TypeError, match="bundle"):
        caller.registered_sync(forward_service_name("server", "0"), args=("not a bundle", 0.0))
    # a push, and a ledger request, each to its own service
    push = caller.registered_sync(reducer_service_name("server", "1"), args=(GradMessage(ones, "c", 1, 1),))
    assert push == (True, 1)
    assert caller.registered_sync(ledger_service_name("server", "1")).clients["c"].accepted == 1
    assert caller.registered_sync(ledger_service_name("server", "0")).clients["c"].applied >= 1


def test_dead_secondary_is_skipped_once(hub3: Hub, impls: list[PushPullGradServerImpl]) -> None:
    _tree(hub3, impls, ["1", "2"], reduce_batch_size=1, flush_timeout=None)
    client = hub3.group("1").get_paired("server").to_here()
    client.set_seed(0)
    hub3.dead.add(client.next_secondary())
    model = ThreeLayer()
    backward_once(model)
    assert client.push(model) is True
    assert impls[0].wait_for_version(1, WAIT)
    hub3.dead.update({"1", "2"})
    backward_once(model)
    with pytest.raises(ConnectionError, match="unreachable"):
        client.push(model)


def test_client_errors(hub3: Hub, impls: list[PushPullGradServerImpl]) -> None:
    _tree(hub3, impls, ["0"])
    client = hub3.group("1").get_paired("server").to_here()
    model = ThreeLayer()
    with pytest.raises(RuntimeError, match=r"parameter 'fc1\.weight' has no gradient"):
        client.push(model)
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        client.push(object())
    with pytest.raises(TypeError, match="seed must be an int or a str"):
        client.set_seed(1.5)


def test_constructor_validation(hub3: Hub) -> None:
    g0 = hub3.group("0")
    cases: list[tuple[dict[str, object], type[Exception], str]] = [
        ({"reduce_method": "max"}, ValueError, "reduce_method must be 'sum' or 'mean'"),
        ({"reduce_batch_size": 0}, ValueError, "reduce_batch_size must be an int >= 1, got 0"),
        ({"reduce_batch_size": 2.0}, TypeError, "reduce_batch_size must be an int"),
        ({"max_queue_size": 2, "reduce_batch_size": 4}, ValueError, "max_queue_size \\(2\\) must be >="),
        ({"flush_timeout": 0}, ValueError, "flush_timeout must be None or a positive number of seconds"),
        ({"max_staleness": -1}, ValueError, "max_staleness must be None or an int >= 0"),
        ({"secondary_reducers": ["9"]}, ValueError, "not members of the group"),
        ({"secondary_reducers": []}, ValueError, "non-empty list"),
        ({"secondary_reducers": ["1", "1"]}, ValueError, "duplicates"),
        ({"o_server": 3}, TypeError, "o_server must be an OrderedServerBase"),
    ]
    for kwargs, exc, message in cases:
        with pytest.raises(exc, match=message):
            PushPullGradServerImpl("s", g0, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="neither the primary reducer"):
        PushPullGradServerImpl("s", hub3.group("2"), primary_reducer="0", secondary_reducers=["1"])
    sec = PushPullGradServerImpl("s2", hub3.group("1"), primary_reducer="0", secondary_reducers=["1"])
    with pytest.raises(RuntimeError, match="not the primary reducer"):
        sec.manage_model(ThreeLayer(), PlainSGD([]))
    prim = PushPullGradServerImpl("s3", g0, secondary_reducers=["1"])
    with pytest.raises(RuntimeError, match="manage_model"):
        prim.start()
    with pytest.raises(TypeError, match="step"):
        prim.manage_model(ThreeLayer(), object())
    prim.manage_model(ThreeLayer(), PlainSGD([]))
    prim.start()
    prim.stop(timeout=WAIT, secondaries_timeout=0)  # its secondary "1" never existed: do not wait for it
    prim.stop(timeout=WAIT, secondaries_timeout=0)  # idempotent
    with pytest.raises(ReducerStoppedError):
        prim.start()


def test_a_server_from_a_built_config_runs_the_same_tree(
    hub3: Hub, impls: list[PushPullGradServerImpl]
) -> None:
    model = ThreeLayer()
    for name in ("0", "1"):
        group = hub3.group(name)
        config = GradServerConfig.build(
            group, "server", secondary_reducers=["0", "1"], reduce_batch_size=1, flush_timeout=None
        )
        impl = PushPullGradServerImpl.from_config(group, config)  # type: ignore[arg-type]
        assert impl.config is config
        if name == "0":
            impl.manage_model(model, PlainSGD(model.parameters()))
        impl.start()
        impls.append(impl)
    client = hub3.group("2").get_paired("server").to_here()
    pushed = ThreeLayer()
    backward_once(pushed)
    pushed.pp_version = 0
    assert client.push(pushed) is True
    assert impls[0].wait_for_version(1, WAIT), impls[0].stats()
    assert impls[0].stats().steps == 1


def test_a_config_is_refused_by_the_wrong_member_or_when_it_is_no_config(hub3: Hub) -> None:
    config = GradServerConfig.build(hub3.group("1"), "server", secondary_reducers=["1"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="built for member '1', not for this process \\('2'\\)"):
        PushPullGradServerImpl.from_config(hub3.group("2"), config)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config must be a GradServerConfig, got dict"):
        PushPullGradServerImpl.from_config(hub3.group("1"), {"server_name": "server"})  # type: ignore[arg-type]
    assert "server" not in hub3.paired
