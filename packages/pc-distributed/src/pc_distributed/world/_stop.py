"""The bounded part of ``World.stop``: leave the RPC groups and meet the other ranks through the store.

torch's store requests other than ``wait`` have no deadline of their own: when the store's host is partitioned
away or frozen they would block until TCP gives up (about 15 minutes), so this whole part runs under
:func:`~pc_distributed._bounded.call_bounded` with ``timeout + STOP_STORE_MARGIN`` seconds; a store that does
not answer is left behind with a ``RuntimeWarning`` and RPC then shuts down non-gracefully.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

from pc_distributed._bounded import call_bounded
from pc_distributed._host import StoreClient, Waiter
from pc_distributed._store import store_barrier

__all__ = ["STOP_STORE_MARGIN", "leave_store"]

logger = logging.getLogger(__name__)

# Seconds World.stop gives its store requests beyond its own barrier timeout before it leaves without them.
STOP_STORE_MARGIN = 2.0


def leave_store(
    name: str,
    store: StoreClient,
    waits: Waiter,
    members: Sequence[str],
    rpc_groups: Sequence[Any],
    meet: bool,
    timeout: float,
    graceful: bool,
) -> bool:
    """Destroy the RPC groups, then (if ``meet``) meet every rank; bounded. Return whether RPC may wait.

    Args:
        name: This member's name.
        store: The World's bounded store client.
        waits: The World's blocking-wait clients.
        members: Every member's name, by rank.
        rpc_groups: The live RPC groups to destroy.
        meet: Whether to meet the others (worlds with RPC do).
        timeout: Seconds of the barrier.
        graceful: Whether the caller wants a graceful RPC shutdown.
    """

    def run() -> bool:
        for group in rpc_groups:
            try:
                group.destroy()
            except Exception as exc:
                logger.debug("destroying RPC group %r failed: %r", group.get_group_name(), exc)
        if not meet:
            return graceful
        return _stop_barrier(name, store, waits, members, timeout, wait=graceful)

    try:
        return call_bounded(run, timeout + STOP_STORE_MARGIN, f"World.stop of {name!r}: the store")
    except TimeoutError as exc:
        warnings.warn(
            f"{exc}; leaving without it (RPC shuts down non-gracefully)", RuntimeWarning, stacklevel=3
        )
        return False


def _stop_barrier(
    name: str, store: StoreClient, waits: Waiter, members: Sequence[str], timeout: float, wait: bool
) -> bool:
    """Meet every rank in ``stop`` through the store; return whether RPC may stop gracefully.

    torch's graceful shutdown waits for a dead peer with the store's timeout, not the one passed to it; this
    barrier notices a missing rank within ``timeout`` instead. A rank that leaves non-gracefully (``wait`` is
    False) still arrives, and marks the stop as abandoned so that the others do not wait for it in torch's
    shutdown either.
    """
    try:
        if not wait:
            store.set("world/stop_abandoned", name)
        store_barrier(store, waits, "world/stop", 0, name, members, timeout, wait=wait)
        if wait and store.check(["world/stop_abandoned"]):
            logger.info("World.stop: a rank left non-gracefully; shutting RPC down non-gracefully")
            return False
        return wait
    except (TimeoutError, RuntimeError, OSError) as exc:
        if wait:
            warnings.warn(
                f"World.stop: {exc}; shutting RPC down non-gracefully", RuntimeWarning, stacklevel=4
            )
        return False
