"""Issue 14 part 4 in process: the ordered and model servers' state dicts (round trip, refusals, bad input).

The gradient server's checkpoints are in test_server_checkpoint.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from server_fakegroup import Hub
from server_models import ThreeLayer, through_disk

from pc_server import OrderedServerSimple, OrderedServerSimpleImpl, PushPullModelServerImpl


# ------------------------------------------------------------------------------------------- ordered server
def test_ordered_round_trip_keeps_every_version(hub3: Hub) -> None:
    server = OrderedServerSimpleImpl("kv", hub3.group("0"), version_depth=3)
    client = OrderedServerSimple("kv", hub3.group("1"))
    for v in range(1, 5):
        assert client.push("a", torch.full((2,), float(v)), v, v - 1 if v > 1 else None)
    assert client.push("b", {"x": 7}, "tag", None)
    state = through_disk(server.state_dict())
    assert [v for v, _ in state["entries"]["a"]] == [2, 3, 4]

    restored = OrderedServerSimpleImpl("kv2", Hub(["0"]).group("0"), version_depth=3)
    restored.load_state_dict(state)
    for v in (2, 3, 4):
        value, version = restored.pull("a", v)
        assert version == v
        assert value.tolist() == [float(v)] * 2
    assert restored.pull("b") == ({"x": 7}, "tag")
    assert restored.pull("a", 1) is None  # trimmed before the checkpoint
    # the loaded head is the head: a compare-and-set must name it
    assert restored.push("a", torch.zeros(2), 5, 3) is False
    assert restored.push("a", torch.zeros(2), 5, 4) is True


def test_ordered_state_is_a_copy_and_loading_while_serving_swaps_content(hub3: Hub) -> None:
    server = OrderedServerSimpleImpl("kv", hub3.group("0"))
    client = OrderedServerSimple("kv", hub3.group("1"))
    client.push("a", torch.ones(2), 1, None)
    state = server.state_dict()
    state["entries"]["a"][0][1].fill_(9.0)  # mutating the checkpoint does not touch the server
    assert server.pull("a")[0].tolist() == [1.0, 1.0]
    client.push("a", torch.zeros(2), 2, 1)
    server.load_state_dict(state)  # well defined while serving: the whole content is replaced
    value, version = client.pull("a")
    assert version == 1
    assert value.tolist() == [9.0, 9.0]
    assert client.push("a", torch.zeros(2), 3, 2) is False  # the pre-load head 2 is gone


def test_ordered_load_trims_to_this_servers_depth(hub3: Hub) -> None:
    deep = OrderedServerSimpleImpl("kv", hub3.group("0"), version_depth=4)
    for v in range(1, 5):
        deep.push("a", v, v, v - 1 if v > 1 else None)
    shallow = OrderedServerSimpleImpl("kv2", hub3.group("0"), version_depth=2)
    shallow.load_state_dict(deep.state_dict())
    assert [v for v, _ in shallow.state_dict()["entries"]["a"]] == [3, 4]


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda s: [1, 2], TypeError, "state_dict must be a dict"),
        (
            lambda s: {**s, "format": "pc_server.PushPullModelServerImpl"},
            ValueError,
            "PushPullModelServerImpl",
        ),
        (lambda s: {**s, "format_version": 99}, ValueError, "format_version 99"),
        (lambda s: {k: v for k, v in s.items() if k != "entries"}, ValueError, r"lacks \['entries'\]"),
        (lambda s: {**s, "entries": {"a": [(1, "x", "extra")]}}, ValueError, "key 'a' must map to"),
        (lambda s: {**s, "entries": {"a": [(1, "x"), (1, "y")]}}, ValueError, "key 'a' repeats a version"),
        (lambda s: {**s, "entries": {"a": [(None, "x")]}}, ValueError, "key 'a' holds the version None"),
        (lambda s: {**s, "entries": {"a": []}}, ValueError, "key 'a' has no versions"),
    ],
)
def test_ordered_bad_state_is_named_and_changes_nothing(
    hub3: Hub, mutate: Any, error: type, match: str
) -> None:
    server = OrderedServerSimpleImpl("kv", hub3.group("0"))
    server.push("k", 1, 1, None)
    with pytest.raises(error, match=match):
        server.load_state_dict(mutate(server.state_dict()))
    assert server.pull("k") == (1, 1)


# --------------------------------------------------------------------------------------------- model server
def test_model_server_round_trip(hub3: Hub) -> None:
    impl = PushPullModelServerImpl("ms", hub3.group("0"))
    client = hub3.group("1").get_paired("ms").to_here()
    model = ThreeLayer()
    for _ in range(3):
        with torch.no_grad():
            model.fc1.weight.add_(1.0)
        assert client.push(model)
    state = through_disk(impl.state_dict())

    hub = Hub(["0", "1"])
    restored = PushPullModelServerImpl("ms", hub.group("0"))
    restored.load_state_dict(state)
    fresh = ThreeLayer()
    assert hub.group("1").get_paired("ms").to_here().pull(fresh)
    assert fresh.pp_version == 3
    assert fresh.weights() == (4.0, 2.0, 3.0)

    with pytest.raises(ValueError, match="holds model 'model', this server manages 'other'"):
        PushPullModelServerImpl("ms2", hub.group("0"), model_name="other").load_state_dict(state)
    with pytest.raises(ValueError, match=r"written by 'pc_server\.PushPullModelServerImpl'"):
        OrderedServerSimpleImpl("kv", hub.group("0")).load_state_dict(state)
    custom = PushPullModelServerImpl(
        "ms3", hub.group("0"), o_server=OrderedServerSimple("ms_o_server", hub.group("0"))
    )
    with pytest.raises(RuntimeError, match="custom o_server"):
        custom.state_dict()
