"""An in-process stand-in for pc_distributed.RpcGroup: several named "processes" sharing one hub.

Arguments and results of service calls go through pickle, as over RPC, so copy semantics match; the accessor's
group handle re-binds to the calling "process" when unpickled, like the real handle does.
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
        self, key: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if key not in self.hub.services:
            raise KeyError(f"Service with key {key} not found on Group")
        owner, fn = self.hub.services[key]
        if owner in self.hub.dead:
            raise ConnectionError(f"worker {owner!r} is dead")
        self.hub.calls.append(key)
        data = pickle.dumps((args, kwargs or {}))
        a, kw = _as(owner, lambda: pickle.loads(data))
        result = fn(*a, **kw)
        return _as(self.name, lambda: pickle.loads(pickle.dumps(result)))
