"""The gradient server's load_state_dict: idempotent; a checkpoint that does not fit whole changes nothing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from server_fakegroup import Hub
from server_models import ThreeLayer, through_disk

from pc_server import PushPullGradServerImpl

WAIT = 20.0


@pytest.fixture
def impls() -> Iterator[list[PushPullGradServerImpl]]:
    created: list[PushPullGradServerImpl] = []
    yield created
    for impl in reversed(created):
        impl.stop(timeout=WAIT)


def _server(impls: list[PushPullGradServerImpl], optimizer: Any, scheduler: Any = None) -> Any:
    """A primary that is its own only secondary (not started), managing a ThreeLayer; and a client."""
    hub = Hub(["0", "1"])
    impl = PushPullGradServerImpl("gs", hub.group("0"), secondary_reducers=["0"], flush_timeout=None)
    impls.append(impl)
    model = ThreeLayer()
    opt = optimizer(model.parameters())
    impl.manage_model(model, opt, None if scheduler is None else scheduler(opt))
    return impl, model, hub.group("1").get_paired("gs").to_here()


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0)


def _push_ones(client: Any, n: int) -> None:
    model = ThreeLayer()
    for _ in range(n):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        assert client.push(model) is True


def test_loading_the_same_checkpoint_twice_applies_its_held_pushes_once(
    impls: list[PushPullGradServerImpl],
) -> None:
    writer, _model, client = _server(impls, _sgd)
    _push_ones(client, 3)  # queued: the writer never starts
    state = through_disk(writer.state_dict())
    assert len(state["secondary"]["pending"]) == 3

    reader, model, _client = _server(impls, _sgd)
    reader.load_state_dict(state)
    reader.load_state_dict(state)
    assert len(reader.state_dict()["secondary"]["pending"]) == 3
    reader.start()
    reader.stop(timeout=WAIT)
    ledger = reader.ledger()
    assert (ledger.total.accepted, ledger.total.applied) == (3, 3)
    assert ledger.balanced()
    assert model.weights() == (-2.0, -1.0, 0.0)


def test_a_load_that_would_erase_booked_pushes_is_refused(impls: list[PushPullGradServerImpl]) -> None:
    writer, _model, _client = _server(impls, _sgd)
    state = writer.state_dict()
    reader, _model, client = _server(impls, _sgd)
    reader.load_state_dict(state)
    _push_ones(client, 1)
    with pytest.raises(RuntimeError, match="booked pushes since it was built or last loaded"):
        reader.load_state_dict(state)
    assert reader.ledger().total.accepted == 1


def _momentum(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.1)


def _trained(impls: list[PushPullGradServerImpl], optimizer: Any, scheduler: Any = None) -> dict[str, Any]:
    """A checkpoint of a server that took a step (so the optimizer has state)."""
    impl, _model, client = _server(impls, optimizer, scheduler)
    impl.start()
    _push_ones(client, 8)
    impl.stop(timeout=WAIT)  # drains: the pushes are applied
    assert impl.stats().version >= 1
    return through_disk(impl.state_dict())


class _BrokenScheduler:
    """A scheduler whose load fails after the model and optimizer were loaded."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def step(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state != {"epoch": 0}:
            raise RuntimeError("cannot load")


def test_a_checkpoint_whose_optimizer_does_not_fit_is_refused_whole(
    impls: list[PushPullGradServerImpl],
) -> None:
    sgd = _trained(impls, _momentum)
    reader, model, _client = _server(impls, _adam)
    optimizer = reader.optimizer
    before = (model.weights(), repr(optimizer.state_dict()))

    with pytest.raises(
        TypeError, match=r"optimizer is a torch\.optim\.sgd\.SGD, the managed optimizer a .*Adam"
    ):
        reader.load_state_dict(sgd)
    untyped = {**sgd, "primary": {k: v for k, v in sgd["primary"].items() if k != "optimizer_type"}}
    with pytest.raises(
        ValueError, match=r"parameter group 0 \(hyper-parameters\) does not fit: missing .*'betas'"
    ):
        reader.load_state_dict(untyped)
    wide = {
        **sgd,
        "primary": {**sgd["primary"], "model": {**sgd["primary"]["model"], "fc1.weight": torch.ones(2, 1)}},
    }
    with pytest.raises(
        ValueError, match=r"model entry 'fc1.weight' has shape \(2, 1\), the managed model's \(1, 1\)"
    ):
        reader.load_state_dict(wide)
    assert (model.weights(), repr(optimizer.state_dict())) == before
    assert reader.stats().version == 0
    assert reader.state_dict()["secondary"]["pending"] == []

    # a part that fails while loading puts back what was loaded before it
    broken, model, _client = _server(impls, _momentum, _BrokenScheduler)
    before = (model.weights(), repr(broken.optimizer.state_dict()))
    state = {**sgd, "primary": {**sgd["primary"], "lr_scheduler": {"epoch": 3}, "lr_scheduler_type": None}}
    with pytest.raises(
        ValueError, match="lr_scheduler state does not fit the managed lr_scheduler: cannot load"
    ):
        broken.load_state_dict(state)
    assert (model.weights(), repr(broken.optimizer.state_dict())) == before
    assert (broken.stats().version, model.pp_version) == (0, 0)

    # the same checkpoint into a server managing what wrote it loads (twice: the same result)
    fits, model, _client = _server(impls, _momentum)
    fits.load_state_dict(sgd)
    fits.load_state_dict(sgd)
    assert fits.stats().version == sgd["primary"]["version"] >= 1
    assert model.weights() != (1.0, 2.0, 3.0)


def test_a_scheduler_of_another_type_is_refused(impls: list[PushPullGradServerImpl]) -> None:
    step = _trained(impls, _momentum, lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2))
    reader, _model, _client = _server(
        impls, _momentum, lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, 0.5)
    )
    with pytest.raises(TypeError, match=r"lr_scheduler is a torch\.optim\.lr_scheduler\.StepLR, the managed"):
        reader.load_state_dict(step)
    untyped = {**step, "primary": {**step["primary"], "lr_scheduler_type": None}}
    with pytest.raises(
        ValueError, match=r"lr_scheduler state does not fit: missing keys \[\], unknown keys .*step_size"
    ):
        reader.load_state_dict(untyped)


def test_a_client_ahead_of_a_restored_server_pulls_its_model_and_its_ahead_push_is_refused(
    impls: list[PushPullGradServerImpl],
) -> None:
    def build(hub: Hub, state: Any = None) -> tuple[PushPullGradServerImpl, ThreeLayer]:
        impl = PushPullGradServerImpl(
            "gs", hub.group("0"), secondary_reducers=["0"], reduce_batch_size=1, flush_timeout=None
        )
        impls.append(impl)
        managed = ThreeLayer()
        impl.manage_model(managed, _sgd(managed.parameters()))
        if state is not None:
            impl.load_state_dict(state)
        impl.start()
        return impl, managed

    hub = Hub(["0", "1"])
    old, _managed = build(hub)
    checkpoint = through_disk(old.state_dict())  # version 0
    client = hub.group("1").get_paired("gs").to_here()
    model = ThreeLayer()
    _push_ones(client, 3)
    assert old.wait_for_version(3, WAIT)
    assert client.pull(model)
    assert (model.pp_version, model.weights()) == (3, (-2.0, -1.0, 0.0))

    hub = Hub(["0", "1"])
    restored, managed = build(hub, checkpoint)
    client = hub.group("1").get_paired("gs").to_here()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    assert client.push(model) is False  # computed on version 3, which this server never published
    assert (model.pp_version, model.weights()) == (0, (1.0, 2.0, 3.0))  # the closing pull brought version 0
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    assert client.push(model) is True
    restored.stop(timeout=WAIT)
    mine = restored.ledger().clients[client.client_id]
    assert (mine.refused_stale, mine.accepted, mine.applied) == (1, 1, 1)
    assert managed.weights() == (0.0, 1.0, 2.0)

    model.pp_version = 5  # kept across a restore: pull() alone brings the server's model too
    assert client.pull(model)
    assert (model.pp_version, model.weights()) == (1, (0.0, 1.0, 2.0))
