"""The ordered server's compare-and-set, version depth and snapshots, in process (no RPC)."""

from __future__ import annotations

import threading

import pytest
import torch
from server_fakegroup import Hub

from pc_server import OrderedServerSimple, OrderedServerSimpleImpl
from pc_server._copy import snapshot
from pc_server._versioned import VersionedStore, is_newer


def test_machin_push_pull_sequence_through_services(hub3: Hub) -> None:
    impl = OrderedServerSimpleImpl("server", hub3.group("0"))
    push, pull = impl._push_service, impl._pull_service
    assert push("a", "value", 1, None)[0] is True
    assert push("a", "value1", 2, 0)[0] is False
    assert push("a", "value2", 2, 1)[0] is True
    assert push("a", "value3", -1, 2)[0] is True
    assert pull("a") == ("value3", -1)
    assert pull("a", 1) is None
    assert pull("b") is None
    assert pull("a", 2) is None  # depth 1 keeps only the newest (machin kept depth + 1)


def test_depth_two_keeps_the_previous_version() -> None:
    store = VersionedStore(version_depth=2)
    for value, version, prev in (("value", 1, None), ("value2", 2, 1), ("value3", -1, 2)):
        assert store.push("a", value, version, prev).accepted
    assert store.pull("a", 2) == ("value2", 2)
    assert store.pull("a", 1) is None
    assert store.versions("a") == [2, -1]


def test_refused_push_reports_head_and_does_not_trim() -> None:
    store = VersionedStore(version_depth=2)
    store.push("a", "x", 1, None)
    store.push("a", "y", 2, 1)
    result = store.push("a", "z", 3, 1, want_newest=True)
    assert (result.accepted, result.head, result.newest) == (False, 2, ("y", 2))
    assert store.versions("a") == [1, 2]


def test_reused_version_in_history_is_refused() -> None:
    store = VersionedStore(version_depth=3)
    store.push("a", "v1", 1, None)
    store.push("a", "v2", 2, 1)
    assert store.push("a", "again", 1, 2).accepted is False
    assert store.pull("a") == ("v2", 2)
    assert store.pull("a", 1) == ("v1", 1)


def test_version_equal_prev_overwrites_head_in_place() -> None:
    store = VersionedStore(version_depth=2)
    store.push("a", "v1", 1, None)
    store.push("a", "v2", 2, 1)
    assert store.push("a", "v2b", 2, 2).accepted
    assert store.pull("a") == ("v2b", 2)
    assert store.versions("a") == [1, 2]
    assert store.push("a", "nope", 2, 1).accepted is False  # prev must be the head


def test_head_is_last_accepted_not_numeric_max() -> None:
    store = VersionedStore()
    store.push("a", "x", 5, None)
    store.push("a", "y", 1, 5)
    assert store.push("a", "z", 6, 5).accepted is False
    assert store.push("a", "z", 6, 1).accepted is True


@pytest.mark.parametrize("bad", [0, -1])
def test_depth_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError, match="version_depth must be an int >= 1, got"):
        VersionedStore(bad)


@pytest.mark.parametrize("bad", [1.5, "2", True, None])
def test_depth_must_be_int(bad: object) -> None:
    with pytest.raises(TypeError, match="version_depth"):
        VersionedStore(bad)  # type: ignore[arg-type]


def test_bad_keys_and_versions() -> None:
    store = VersionedStore()
    with pytest.raises(TypeError, match="key must be hashable"):
        store.push(["list"], 1, 1, None)
    with pytest.raises(ValueError, match="version must not be None"):
        store.push("a", 1, None, None)
    with pytest.raises(TypeError, match="version must be hashable"):
        store.push("a", 1, [1], None)
    assert store.pull("a", [1]) is None


def test_n_concurrent_pushers_exactly_one_winner() -> None:
    store = VersionedStore()
    store.push("k", "base", 0, None)
    n = 16
    barrier = threading.Barrier(n)
    results: list[bool] = []
    lock = threading.Lock()

    def pusher(i: int) -> None:
        barrier.wait(timeout=30)
        ok = store.push("k", f"w{i}", 1, 0).accepted
        with lock:
            results.append(ok)

    threads = [threading.Thread(target=pusher, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == n
    assert results.count(True) == 1
    winner = store.pull("k")
    assert winner is not None
    assert winner[1] == 1
    assert winner[0].startswith("w")


def test_is_newer_rules() -> None:
    assert is_newer(3, None)
    assert is_newer(3, 2)
    assert not is_newer(3, 3)
    assert not is_newer(2, 3)
    assert is_newer("b", 1)
    assert not is_newer("b", "b")


def test_snapshots_are_private(hub3: Hub) -> None:
    impl = OrderedServerSimpleImpl("server", hub3.group("0"))
    value = {"w": torch.zeros(3, requires_grad=True) * 1, "meta": [1, 2]}
    assert impl.push("a", value, 1, None)
    value["w"].data.add_(5)
    value["meta"].append(3)
    pulled = impl.pull("a")
    assert pulled is not None
    assert torch.equal(pulled[0]["w"], torch.zeros(3))
    assert pulled[0]["meta"] == [1, 2]
    pulled[0]["w"].add_(7)
    again = impl.pull("a")
    assert again is not None
    assert torch.equal(again[0]["w"], torch.zeros(3))
    # remote path: accessor from another "process"
    client = hub3.group("1").get_paired("server").to_here()
    assert isinstance(client, OrderedServerSimple)
    got = client.pull("a")
    assert got is not None
    got[0]["w"].add_(1)
    assert torch.equal(impl.pull("a")[0]["w"], torch.zeros(3))  # type: ignore[index]


def test_snapshot_copies_named_tuples_and_nested() -> None:
    from collections import namedtuple

    P = namedtuple("P", "a b")
    src = P(torch.ones(2), {"x": [torch.zeros(1)]})
    out = snapshot(src)
    assert isinstance(out, P)
    src.a.add_(1)
    src.b["x"][0].add_(1)
    assert torch.equal(out.a, torch.ones(2))
    assert torch.equal(out.b["x"][0], torch.zeros(1))


def test_accessor_roundtrip_and_errors(hub3: Hub) -> None:
    OrderedServerSimpleImpl("kv", hub3.group("0"), version_depth=2)
    client = hub3.group("2").get_paired("kv").to_here()
    assert client.push("a", 1, 1, None) is True
    assert client.push("a", 2, 2, 0) is False
    assert client.pull("a") == (1, 1)
    assert client.pull_if_newer("a", 1) == (False, None, 1)
    assert client.pull_if_newer("a", 0) == (True, 1, 1)
    assert client.pull_if_newer("zz", 0) is None
    assert hub3.calls[-1] == "kv/_pull_if_newer_service"
    with pytest.raises(TypeError, match="unexpected keyword"):
        OrderedServerSimpleImpl("kv2", hub3.group("0"), server_runner="0")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"group must be a pc_distributed\.RpcGroup"):
        OrderedServerSimpleImpl("kv3", object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="server_name must be a non-empty str"):
        OrderedServerSimpleImpl("", hub3.group("0"))
    hub3.dead.add("0")
    with pytest.raises(ConnectionError, match="server 'kv' is unreachable"):
        client.pull("a")


def test_push_snapshot_stores_the_object_itself_and_keeps_cas(hub3: Hub) -> None:
    """The public snapshot push (used by the gradient server's publish) keeps the caller's private object."""
    impl = OrderedServerSimpleImpl("snap", hub3.group("0"))
    mine = torch.zeros(2)
    assert impl.push_snapshot("k", mine, 1, None) is True
    mine.add_(7)  # the caller promised not to do this; it shows the store kept this very object (no copy)
    assert impl.pull("k")[0].tolist() == [7.0, 7.0]
    assert impl.push_snapshot("k", torch.ones(2), 3, 2) is False  # compare-and-set as for push
    assert impl.push_snapshot("k", torch.ones(2), 2, 1) is True
