"""The model server through the fake in-process group: versions, pull-on-fail, one call per operation."""

from __future__ import annotations

import pytest
import torch
from server_fakegroup import Hub
from server_models import ThreeLayer

from pc_server import OrderedServerBase, PushPullModelServer, PushPullModelServerImpl


def _bump(model: ThreeLayer) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p += 1


def test_ten_pushes_reach_11_12_13_and_one_call_each(hub3: Hub) -> None:
    PushPullModelServerImpl("server", hub3.group("0"))
    server = hub3.group("1").get_paired("server").to_here()
    assert isinstance(server, PushPullModelServer)
    model = ThreeLayer()
    for i in range(10):
        _bump(model)
        before = len(hub3.calls)
        assert server.push(model) is True
        assert len(hub3.calls) == before + 1
        assert model.pp_version == i + 1
    fresh = ThreeLayer()
    before = len(hub3.calls)
    assert server.pull(fresh) is True
    assert len(hub3.calls) == before + 1
    assert fresh.weights() == (11.0, 12.0, 13.0)
    assert fresh.pp_version == 10


def test_stale_push_fails_and_adopts_newest_in_one_call(hub3: Hub) -> None:
    PushPullModelServerImpl("server", hub3.group("0"))
    a = hub3.group("1").get_paired("server").to_here()
    b = hub3.group("2").get_paired("server").to_here()
    ma, mb = ThreeLayer(), ThreeLayer()
    _bump(ma)
    assert a.push(ma)
    _bump(mb)
    _bump(mb)
    params_before = [id(p) for p in mb.parameters()]
    mb.fc1.weight.grad = torch.full((1, 1), 9.0)
    before = len(hub3.calls)
    assert b.push(mb) is False
    assert len(hub3.calls) == before + 1  # push and pull-on-fail share one round trip
    assert mb.weights() == (2.0, 3.0, 4.0)
    assert mb.pp_version == 1
    assert [id(p) for p in mb.parameters()] == params_before
    assert mb.fc1.weight.grad is not None
    assert mb.fc1.weight.grad.item() == 9.0
    mc = ThreeLayer()
    mc.pp_version = 0
    assert b.push(mc, pull_on_fail=False) is False
    assert mc.weights() == (1.0, 2.0, 3.0)
    assert mc.pp_version == 0


def test_up_to_date_pull_sends_no_state(hub3: Hub) -> None:
    impl = PushPullModelServerImpl("server", hub3.group("0"))
    client = hub3.group("1").get_paired("server").to_here()
    model = ThreeLayer()
    assert client.pull(model) is False  # nothing published yet
    assert client.push(model)
    reply = impl.o_server.pull_if_newer("model", model.pp_version)  # type: ignore[attr-defined]
    assert reply is not None
    assert reply.fresh is False
    assert reply.value is None
    _bump(model)
    assert client.pull(model) is True
    assert model.weights() == (2.0, 3.0, 4.0)  # not newer: nothing loaded
    model2 = ThreeLayer()
    model2.pp_version = 0
    _bump(model2)
    assert client.pull(model2)
    assert model2.weights() == (1.0, 2.0, 3.0)
    assert model2.pp_version == 1


class DictServer(OrderedServerBase):
    """A custom ordered server (in-process dict) to exercise the generic path."""

    def __init__(self) -> None:
        self.data: dict[object, tuple[object, object]] = {}
        self.calls = 0

    def push(self, key: object, value: object, version: object, prev_version: object) -> bool:
        self.calls += 1
        if key in self.data and self.data[key][1] != prev_version:
            return False
        self.data[key] = (value, version)
        return True

    def pull(self, key: object, version: object = None) -> tuple[object, object] | None:
        self.calls += 1
        return self.data.get(key)


def test_custom_o_server_generic_path(hub3: Hub) -> None:
    o = DictServer()
    impl = PushPullModelServerImpl("custom", hub3.group("0"), model_name="net", o_server=o)
    assert impl.o_server_impl is None
    accessor = PushPullModelServer("net", o)
    m1, m2 = ThreeLayer(), ThreeLayer()
    _bump(m1)
    assert accessor.push(m1)
    assert accessor.push(m2) is False
    assert m2.weights() == (2.0, 3.0, 4.0)
    assert o.calls == 3  # push, push, pull
    m3 = ThreeLayer()
    assert accessor.pull(m3)
    assert m3.weights() == (2.0, 3.0, 4.0)


def test_model_server_bad_input(hub3: Hub) -> None:
    PushPullModelServerImpl("server", hub3.group("0"))
    client = hub3.group("1").get_paired("server").to_here()
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got str"):
        client.push("model")
    model = ThreeLayer()
    model.pp_version = "3"
    with pytest.raises(TypeError, match="pp_version must be an int"):
        client.push(model)
    with pytest.raises(TypeError, match="o_server"):
        PushPullModelServerImpl("x", hub3.group("0"), o_server=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="o_server is required"):
        PushPullModelServer("model")
    other = torch.nn.Linear(2, 2)
    client.push(ThreeLayer())
    other.pp_version = -5
    with pytest.raises(RuntimeError, match="state_dict"):
        client.pull(other)
