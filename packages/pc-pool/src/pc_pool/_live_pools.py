"""The registry of live process pools: interpreter exit terminates them; its atexit hook is made lazily."""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Any

__all__ = ["register_pool", "unregister_pool"]

_log = logging.getLogger(__name__)
_live_pools: weakref.WeakSet[Any] = weakref.WeakSet()
_atexit_registered = False
_atexit_lock = threading.Lock()


def _terminate_live_pools() -> None:
    for pool in list(_live_pools):
        try:
            pool.terminate()
        except Exception:  # pragma: no cover - best effort at interpreter exit
            _log.debug("terminating a pool at exit failed", exc_info=True)


def register_pool(pool: Any) -> None:
    """Track a live pool so that interpreter exit terminates it (the atexit hook is installed lazily)."""
    global _atexit_registered
    with _atexit_lock:
        if not _atexit_registered:
            atexit.register(_terminate_live_pools)
            _atexit_registered = True
        _live_pools.add(pool)


def unregister_pool(pool: Any) -> None:
    """Stop tracking a pool that has shut down."""
    _live_pools.discard(pool)
