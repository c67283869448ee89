"""Secondary-to-primary forwards addressed by member name, without the group's service directory.

A secondary knows its primary's member name, so the forward is a plain
``group.rpc_sync(primary, deliver_forward, ...)``: no directory look-up in the store. That look-up, made
lazily from the reducer thread, stalled while the process's main thread waited in ``RpcGroup.barrier()``
(pc-distributed issue 22), long enough for the primary to stop first and the forwarded gradients to be lost
(pc-server issue 14). The primary registers its receiver here, in a process-local table keyed by
``(group name, server name)``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from pc_server.errors import ReducerStoppedError

__all__ = ["deliver_forward", "register_primary"]

_RECEIVERS: dict[tuple[str, str], weakref.WeakMethod[Callable[[Any, float], int]]] = {}
_LOCK = threading.Lock()


def register_primary(group_name: str, server_name: str, receiver: Callable[[Any, float], int]) -> None:
    """Make ``receiver`` (a bound method of the primary) the target of forwards to ``server_name``.

    Held weakly: the entry vanishes with the primary reducer object.
    """
    ref: weakref.WeakMethod[Callable[[Any, float], int]] = weakref.WeakMethod(receiver)
    with _LOCK:
        _RECEIVERS[(group_name, server_name)] = ref


def deliver_forward(group_name: str, server_name: str, forward: Any, age: float) -> int:
    """Run on the primary's process: queue a secondary's forward; return the primary's model version.

    Raises:
        ReducerStoppedError: No primary reducer of ``server_name`` lives in this process (any more).
    """
    with _LOCK:
        ref = _RECEIVERS.get((group_name, server_name))
    receiver = ref() if ref is not None else None
    if receiver is None:
        raise ReducerStoppedError(
            f"gradient server {server_name!r}: no primary reducer of group {group_name!r} "
            "lives in this process"
        )
    return receiver(forward, age)
