"""An accessor in its server's own process: no call goes through the group's RPC, and it gets snapshots.

Through the fake group every RPC is recorded in ``hub.calls``; a call of a service the calling process owns
runs in place, on copies (as ``RpcGroup.registered_sync`` runs it), and is not recorded.
"""

from __future__ import annotations

import torch
from server_fakegroup import Hub

from pc_server import OrderedServerSimple, OrderedServerSimpleImpl


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
