"""An in-process stand-in for pc_distributed.RpcGroup: several named "processes" sharing one hub.

Arguments and results of service calls go through pickle, as over RPC, so copy semantics match; the
accessor's group handle re-binds to the calling "process" when unpickled, like the real handle does.
``hub.calls`` records the calls that would be RPCs: a call of a service the calling "process" owns runs in
place (as RpcGroup runs it, on copies) and is not recorded; a call given its ``owner`` is recorded as
``"<key>@<owner>"`` and skips the directory (it is not stalled by ``stalled_directory``).
"""

from __future__ import annotations

import itertools
import pickle
import threading
from collections.abc import Callable
from typing import Any

_HUBS: dict[int, Hub] = {}
_IDS = itertools.count()
_CURRENT = threading.local()


class Hub:
    def __init__(self, members: list[str]) -> None:
        self.id = next(_IDS)
        _HUBS[self.id] = self
        self.members = sorted(members)
        self.services: dict[str, tuple[str, Callable[..., Any]]] = {}
        self.paired: dict[str, tuple[str, bytes]] = {}
        self.dead: set[str] = set()
        # members whose service-directory look-ups stall (as while their main thread waits in
        # RpcGroup.barrier(), pc-distributed issue 22): registered_sync from them times out
        self.stalled_directory: set[str] = set()
        # service keys whose next call runs the service and then loses the reply (a transient transport error)
        self.lose_reply: set[str] = set()
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def group(self, name: str) -> FakeGroup:
        return FakeGroup(self, name)


def _as(name: str, fn: Callable[[], Any]) -> Any:
    prev = getattr(_CURRENT, "name", None)
    _CURRENT.name = name
    try:
        return fn()
    finally:
        _CURRENT.name = prev


def _rebuild(hub_id: int) -> FakeGroup:
    return FakeGroup(_HUBS[hub_id], _CURRENT.name)


class _Ref:
    def __init__(self, hub: Hub, data: bytes, caller: str) -> None:
        self._data, self._caller = data, caller

    def to_here(self) -> Any:
        return _as(self._caller, lambda: pickle.loads(self._data))


class FakeGroup:
    def __init__(self, hub: Hub, name: str) -> None:
        self.hub, self.name = hub, name

    def __reduce__(self) -> Any:
        return (_rebuild, (self.hub.id,))

    def get_group_name(self) -> str:
        return f"fakehub{self.hub.id}"

    def get_group_members(self) -> list[str]:
        return list(self.hub.members)

    def get_cur_name(self) -> str:
        return self.name

    def is_member(self, target: str | None = None) -> bool:
        return (target or self.name) in self.hub.members

    def register(self, key: str, service: Callable[..., Any]) -> bool:
        with self.hub.lock:
            if key in self.hub.services:
                return False
            self.hub.services[key] = (self.name, service)
            return True

    def pair(self, key: str, value: Any) -> bool:
        with self.hub.lock:
            if key in self.hub.paired:
                return False
            self.hub.paired[key] = (self.name, pickle.dumps(value))
            return True

    def get_paired(self, key: str) -> _Ref:
        if key not in self.hub.paired:
            raise KeyError(f"Value with key {key} not found on Group")
        return _Ref(self.hub, self.hub.paired[key][1], self.name)

    def registered_sync(
        self,
        key: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        *,
        owner: str | None = None,
    ) -> Any:
        if owner is None and self.name in self.hub.stalled_directory:
            raise TimeoutError(f"directory look-up of {key!r} from {self.name!r} stalled")
        if key not in self.hub.services or owner not in (None, self.hub.services[key][0]):
            raise KeyError(f"Service with key {key} not found on Group")
        holder, fn = self.hub.services[key]
        if holder != self.name:  # an RPC; a service of this "process" runs in place
            self.hub.calls.append(key if owner is None else f"{key}@{owner}")
        result = self._run(holder, fn, args, kwargs)
        with self.hub.lock:
            lost = key in self.hub.lose_reply
            self.hub.lose_reply.discard(key)
        if lost:
            raise ConnectionError(f"reply of {key!r} from {holder!r} lost in transport")
        return result

    def rpc_sync(
        self,
        to: str,
        func: Callable[..., Any],
        timeout: float = -1,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if to not in self.hub.members:
            raise ValueError(f"RPC target {to!r} is not a member")
        self.hub.calls.append(f"rpc_sync:{to}:{getattr(func, '__name__', func)}")
        return self._run(to, func, args, kwargs)

    def _run(self, owner: str, fn: Callable[..., Any], args: Any, kwargs: dict[str, Any] | None) -> Any:
        if owner in self.hub.dead:
            raise ConnectionError(f"worker {owner!r} is dead")
        data = pickle.dumps((tuple(args), kwargs or {}))
        a, kw = _as(owner, lambda: pickle.loads(data))
        result = _as(owner, lambda: fn(*a, **kw))
        return _as(self.name, lambda: pickle.loads(pickle.dumps(result)))
