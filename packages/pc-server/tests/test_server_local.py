"""In-process short cuts (``pc_server._local``): who finds a server in its own process, and what it gets.

Through the fake group every RPC is recorded in ``hub.calls``; an accessor on the very group object its server
was created with calls the server directly (nothing recorded), any other accessor goes through the "RPC".
"""

from __future__ import annotations

import gc

import torch
from server_fakegroup import Hub

from pc_server import OrderedServerSimple, OrderedServerSimpleImpl
from pc_server._local import find_local, register_local


class _Server:
    def serve(self) -> str:
        return "served"


def test_found_only_on_the_registering_group_object_while_both_live() -> None:
    hub = Hub(["0", "1"])
    group, other_view = hub.group("0"), hub.group("0")  # the same member, but another group object
    server = _Server()
    register_local(group, "svc", server.serve)
    found = find_local(group, "svc")
    assert found is not None
    assert found() == "served"
    assert find_local(other_view, "svc") is None  # e.g. a handle that is not the live group
    assert find_local(group, "other") is None
    group.destroyed = True  # type: ignore[attr-defined]  # as RpcGroup.destroy() sets it
    assert find_local(group, "svc") is None
    group.destroyed = False  # type: ignore[attr-defined]
    del server, found
    gc.collect()
    assert find_local(group, "svc") is None  # held weakly: gone with its server


def test_ordered_server_accessor_in_the_serving_process_makes_no_call_and_gets_snapshots() -> None:
    hub = Hub(["0", "1"])
    group = hub.group("0")
    impl = OrderedServerSimpleImpl("kv", group)
    local = OrderedServerSimple("kv", group)
    value = torch.ones(3)
    assert local.push("a", value, 1, None) is True
    value.add_(10)  # the caller's tensor changes after the push
    pulled = local.pull("a")
    assert pulled is not None
    pulled[0].add_(20)  # and what it pulled
    fresh = local.pull_if_newer("a", None)
    assert fresh is not None
    assert fresh.fresh
    fresh.value.add_(30)
    refused = local.push_service_call("a", torch.zeros(3), 5, 3, want_newest=True)
    assert (refused.accepted, refused.head) == (False, 1)
    assert refused.newest is not None
    refused.newest[0].add_(40)
    stored = impl.peek("a")
    assert stored is not None
    assert stored[0].tolist() == [1.0, 1.0, 1.0]
    assert local.pull_if_newer("a", 1) == (False, None, 1)
    assert hub.calls == []  # not one call went through the group

    remote = OrderedServerSimple("kv", hub.group("1"))  # another process: through the group, as before
    assert remote.pull("a") is not None
    assert hub.calls == ["kv/_pull_service"]


class _NoWeakrefGroup:
    __slots__ = ()


def test_a_group_without_weak_references_gets_no_short_cut() -> None:
    group = _NoWeakrefGroup()
    server = _Server()
    register_local(group, "svc", server.serve)  # no error: the server is simply reached by RPC
    assert find_local(group, "svc") is None
