"""The elastic trainer's connections to a store that outlives the workers.

The store is the source of truth of an elastic job (members, heartbeats, quorums, step decisions), so it
must be served by a process that outlives every worker: torchrun's agent or ``run_world``'s launcher. A store
served by a rank (rank 0 of a World started without an agent) would take the whole job with it when that rank
dies, which is exactly the failure the trainer exists to survive, so it is refused.

A member keeps five kinds of connection (one per role, as the World does): short requests of the training
loop, short requests of the heartbeat thread (never queued behind the loop's), those of the housekeeping
thread, one connection per blocking wait (``WaitStores``), and one for the quorum groups' rendezvous. Stores
other than ``TCPStore`` (a ``HashStore``, ``FileStore`` or ``EtcdStore``) are shared by all of them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pc_distributed import _store
from pc_distributed._store import BoundedStore, WaitStores

__all__ = ["ElasticStores", "connect"]

_PREFIX = "pc_elastic"


@dataclass
class ElasticStores:
    """A member's store connections, all with the job's key prefix except ``raw``.

    Attributes:
        store: Short requests of the training loop.
        beat: Short requests of the heartbeat thread.
        chores: Short requests of the housekeeping thread.
        waits: Blocking waits, a connection each.
        raw: The unprefixed client the quorum groups' stores are made from.
        prefix: The job's key prefix (``pc_elastic/<job>``).
        timeout: Seconds of each request.
    """

    store: BoundedStore
    beat: BoundedStore
    chores: BoundedStore
    waits: WaitStores
    raw: Any
    prefix: str
    timeout: float

    def group_store(self) -> Any:
        """A client for one quorum group's rendezvous (a connection of its own on a TCPStore)."""
        return _store.store_client(self.raw, self.timeout) or self.raw

    def close(self) -> None:
        """Close the clients (never blocks)."""
        self.store.close()
        self.beat.close()
        self.chores.close()
        self.waits.close()


def _agent_store(timeout: float) -> Any:
    """A client of the store torchrun's agent or ``run_world`` serves, from the environment.

    Raises:
        ValueError: If no address is set, or the store would be served by a rank (no agent).
        TimeoutError: If the store does not answer within ``timeout``.
    """
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise ValueError(
            "ElasticDataParallel needs a store served by a launcher that outlives the workers: run under "
            "torchrun or run_world (which set MASTER_ADDR/MASTER_PORT and serve the store), or pass store="
        )
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        raise ValueError(
            f"the store at {addr}:{port} is served by rank 0, not by an agent (TORCHELASTIC_USE_AGENT_STORE "
            "is not 'True'): rank 0's death would take the store and the whole elastic job with it. Run "
            "under torchrun (with its shared store) or run_world, or pass store= served by a process that "
            "outlives the workers"
        )
    try:
        port_number = int(port)
    except ValueError:
        raise ValueError(f"environment variable MASTER_PORT must be an integer, got {port!r}") from None
    try:
        return _store.tcp_store_client(addr, port_number, timeout)
    except (RuntimeError, OSError) as exc:
        raise TimeoutError(
            f"the elastic store at {addr}:{port} is not reachable within {timeout:g} s: {exc}"
        ) from exc


def connect(store: Any, job: str, timeout: float) -> ElasticStores:
    """Open a member's connections to ``store`` (None: the agent's store named by the environment).

    Raises:
        TypeError: If ``store`` is neither None nor a torch ``Store``.
        ValueError: If ``store`` is None and no agent serves the environment's store.
        TimeoutError: If the store does not answer within ``timeout``.
    """
    if store is None:
        raw = _agent_store(timeout)
    elif isinstance(store, _store.Store):
        raw = store
    else:
        raise TypeError(
            "store must be None (the store of torchrun's agent or run_world) or a torch.distributed.Store "
            f"served by a process that outlives the workers, got {type(store).__name__}"
        )
    prefix = f"{_PREFIX}/{job}"
    label = f"the elastic store of job {job!r}"
    server = "the launcher serving it (torchrun's agent or run_world)"
    beat_client = _store.store_client(raw, timeout) or raw
    chores_client = _store.store_client(raw, timeout) or raw
    return ElasticStores(
        store=BoundedStore(_store.prefix_store(prefix, raw), timeout, label, server),
        beat=BoundedStore(_store.prefix_store(prefix, beat_client), timeout, label, server),
        chores=BoundedStore(_store.prefix_store(prefix, chores_client), timeout, label, server),
        waits=WaitStores(raw, prefix, timeout),
        raw=raw,
        prefix=prefix,
        timeout=timeout,
    )
