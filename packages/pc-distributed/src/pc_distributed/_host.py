"""What the groups need from their World, and this process's current World.

:class:`GroupHost` is the part of :class:`~pc_distributed.World` that ``CollectiveGroup`` and ``RpcGroup``
use, written as a protocol so that the group modules never import ``pc_distributed.world`` (the world
imports them: the arrows point one way). A live group holds its World, given at creation; only a group
handle rebuilt from a pickle in another process looks the process's World up, once, through
:func:`current_world`.

The slot itself lives here, not in ``pc_distributed.world``, for the same reason. It is the package's one
process-wide pointer, and it has to be: torch runs an incoming RPC as a module-level function with nothing
but its arguments, and ``get_world()`` is the public way for code to find the process's World. Everything
else that outlives a call (the RPC groups, their tables of values and services, the collective groups)
belongs to the World and goes with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from pc_distributed._store import StoreClient, Waiter

__all__ = ["GroupHost", "clear_world", "current_world", "install_world"]


class GroupHost(Protocol):
    """The World as the groups see it: names, the store, the defaults and the registries of groups."""

    @property
    def name(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def rpc_timeout(self) -> float: ...
    @property
    def init_rpc(self) -> bool: ...
    @property
    def store(self) -> StoreClient: ...
    @property
    def waits(self) -> Waiter: ...
    @property
    def rpc_agent(self) -> Any:
        """The World's RPC backend (``rpc._backend.RpcBackend``; None without RPC): what calls travel on."""

    @property
    def rpc_tables(self) -> Any:
        """The World's ``ProcessTables`` (``rpc._remote``): its RPC groups' values and services."""

    def get_members(self) -> list[str]: ...
    def get_rpc_group(self, group_name: str) -> Any: ...
    def next_rpc_group_instance(self, group_name: str) -> int: ...
    def attach_rpc_group(self, group_name: str, group: Any) -> None: ...
    def detach_rpc_group(self, group_name: str, group: Any) -> None: ...
    def next_collective_seq(self) -> int: ...
    def attach_collective_group(self, group: Any) -> None: ...


_CURRENT: Any = None
_LOCK = threading.Lock()


def current_world() -> Any:
    """This process's running World, or None."""
    return _CURRENT


def install_world(world: Any, start: Callable[[], None]) -> None:
    """Run ``start()`` and make ``world`` the process's World, both under the slot's lock.

    Raises:
        RuntimeError: If another World is running.
        Exception: ``start``'s own error (then nothing is installed).
    """
    global _CURRENT
    with _LOCK:
        if _CURRENT is not None:
            raise RuntimeError("World could only be initialized once!")
        start()
        _CURRENT = world


def clear_world(world: Any) -> None:
    """Forget ``world`` if it is the process's World (idempotent)."""
    global _CURRENT
    with _LOCK:
        if _CURRENT is world:
            _CURRENT = None
