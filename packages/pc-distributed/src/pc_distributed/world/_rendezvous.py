"""The bounded start of a World: open (or serve) the rendezvous store, publish the member's name and settings.

Every step is bounded by the World's ``dist_timeout``: torch's TCPStore client waits for the server's
handshake with no deadline, so opening a client runs under :func:`~pc_distributed._bounded.call_bounded`,
and every later request goes through a :class:`~pc_distributed._store.BoundedStore`.

A rank 0 that serves the store itself (no torchrun agent) binds exactly the rendezvous address it was given
(loopback by default), never every interface, unless that address is ``0.0.0.0``/``::``. The same holds for a
store of TensorPipe's own (an ``rpc_init_method`` naming another address): no agent serves that one, so rank 0
always does.

Before anything else starts, the members compare the settings that must agree (the RPC backend, the
process-group backend): a mismatch would otherwise surface only after ``dist_timeout``, as a raw torch error
or an abort, on some ranks. Every rank reads the same table, so every rank raises the same ``ValueError``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pc_distributed import _store
from pc_distributed._bounded import call_bounded
from pc_distributed._store import BoundedStore, WaitStores, wait_keys
from pc_distributed.world._env import WorldSpec
from pc_distributed.world._rpc_store import rpc_url_for_store

__all__ = ["Connection", "connect", "publish_name"]

logger = logging.getLogger(__name__)

_PREFIX = "pc_distributed"
# The Worlds this process has made, numbered from 1. A counter's next() is one atomic step under the GIL, so
# two threads that make Worlds at once (the second one is then refused) never get the same number.
_EPOCHS = itertools.count(1)


def _next_epoch() -> int:
    return next(_EPOCHS)


@dataclass
class Connection:
    """A World's connections to the store.

    Attributes:
        raw: torch's store (the server on rank 0, else a client).
        store: The bounded shared client (short requests), with the World's key prefix.
        waits: The clients for blocking waits, with the same prefix.
        rpc_url: RPC's init method (``:0`` replaced by the served port).
        prefix: The World's key prefix.
        outlives_attempt: True when an agent serves the store, which then outlives a torchrun restart.
        serves: True when this process serves the store (rank 0 without an agent).
        rpc_store: TensorPipe's store of its own (an ``rpc_init_method`` naming another address), once opened.
    """

    raw: Any
    store: BoundedStore
    waits: WaitStores
    rpc_url: str
    prefix: str = _PREFIX
    outlives_attempt: bool = False
    serves: bool = False
    rpc_store: Any = field(default=None, repr=False)

    def pg_store(self, timeout: float) -> Any:
        """The process group's store: a client of its own (gloo's waits never stall the World's requests).

        On a store that outlives a torchrun restart the group's keys are scoped to this attempt, else a
        restarted worker would read the dead attempt's gloo addresses.
        """
        client = _store.store_client(self.raw, timeout) or self.raw
        return _store.prefix_store(f"{self.prefix}/pg", client) if self.outlives_attempt else client

    def link_store(self, timeout: float) -> Any:
        """The c10d RPC backend's store: a client of its own, scoped to this World (``<prefix>/links``)."""
        client = _store.store_client(self.raw, timeout) or self.raw
        return _store.prefix_store(f"{self.prefix}/links", client)

    def rpc_init_method(self, spec: WorldSpec, name: str, timeout: float) -> str:
        """TensorPipe's init method.

        On the World's store (the default), its URL, or on a store that outlives a restart a client scoped
        to this attempt. On an address of RPC's own (``spec.rpc_host``), a store served by rank 0 on exactly
        that address and opened by the others (within ``timeout``), handed to RPC.

        Raises:
            TimeoutError: If RPC's own store cannot be reached within ``timeout``.
            OSError: If rank 0 cannot bind its address.
        """
        if spec.rpc_host is not None and spec.rpc_port is not None:
            if spec.rank == 0:
                what = "rpc_init_method"
                self.rpc_store = _serve(spec.rpc_host, spec.rpc_port, spec.world_size, timeout, what)
            else:
                self.rpc_store = _open(spec.rpc_url, name, spec.rank, spec.world_size, timeout, "RPC store")
            return rpc_url_for_store(self.rpc_store)
        if self.outlives_attempt and self.rpc_url == spec.dist_url:
            client = _store.store_client(self.raw, timeout)
            if client is not None:
                return rpc_url_for_store(_store.prefix_store(f"{self.prefix}/rpc", client))
        return self.rpc_url

    def close(self) -> None:
        """Close the clients (never blocks)."""
        self.waits.close()
        self.store.close()
        self.rpc_store = None


def _serve(host: str | None, port: int | None, world_size: int, timeout: float, given_as: str) -> Any:
    host = "127.0.0.1" if host in (None, "localhost") else str(host)
    try:
        return _store.master_store(host, port or 0, world_size, timeout)
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"rank 0 cannot serve the rendezvous store on {host}:{port or 0} ({exc.strerror}); the "
            f"address ({given_as}) must be one of this host's and the port free",
        ) from exc


def _open(url: str, name: str, rank: int, world_size: int, timeout: float, kind: str) -> Any:
    what = f"World {name!r}: the {kind} at {url}"
    hint = (
        "is rank 0 (or torchrun's agent) running and serving it, and is that address reachable from this "
        "host? Pass addr=/interface= to World or set MASTER_ADDR/MASTER_PORT"
    )
    try:
        # torch's client waits for the server's handshake with no deadline: a rendezvous address that accepts
        # connections and never answers (a frozen rank 0) would block here forever.
        return call_bounded(lambda: _store.open_store(url, rank, world_size, timeout), timeout, what)
    except (RuntimeError, OSError) as exc:  # silent, refused, unreachable, or torch's own connect timeout
        detail = "no answer" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
        raise TimeoutError(f"{what}: not reachable within {timeout:g} s ({detail}); {hint}") from exc


def connect(spec: WorldSpec, name: str, rank: int, world_size: int, timeout: float) -> Connection:
    """Serve or open the store and build the World's bounded clients (undone by :meth:`Connection.close`).

    Raises:
        TimeoutError: If the rendezvous store cannot be reached or does not answer within ``timeout``.
        OSError: If rank 0 cannot bind the rendezvous address.
    """
    given_as = "dist_init_method, or addr= / MASTER_ADDR and MASTER_PORT"
    raw = (
        _serve(spec.host, spec.port, world_size, timeout, given_as)
        if spec.serves_store()
        else _open(spec.dist_url, name, rank, world_size, timeout, "rendezvous store")
    )
    # Keys are scoped per torchrun restart and per World of this process (every rank creates its Worlds in the
    # same order), so a store that outlives a World never shows it stale keys. Only an agent's store outlives
    # the workers; a store served by rank 0 is new in every attempt (and the hosts' restart counts can differ:
    # a c10d agent restarting for a membership change counts none).
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if spec.agent_store else "0"
    prefix = f"{_PREFIX}/{restart}/{_next_epoch()}"
    if spec.serves_store():
        server = f"this process (rank 0, {name!r}), which serves it"
    elif spec.agent_store:
        server = f"the launcher serving it at {spec.dist_url} (torchrun's agent or run_world)"
    else:
        server = f"rank 0, which serves it at {spec.dist_url}"
    label = f"the store of World {name!r}"
    store = BoundedStore(_store.prefix_store(prefix, raw), timeout, label, server)
    waits = WaitStores(raw, prefix, timeout)
    rpc_url = spec.rpc_url
    port = _store.store_port(raw)
    if rpc_url.endswith(":0") and port is not None:
        rpc_url = f"{rpc_url[:-2]}:{port}"
    return Connection(
        raw=raw,
        store=store,
        waits=waits,
        rpc_url=rpc_url,
        prefix=prefix,
        outlives_attempt=spec.agent_store,
        serves=spec.serves_store(),
    )


def publish_name(
    conn: Connection,
    name: str,
    rank: int,
    world_size: int,
    timeout: float,
    settings: Mapping[str, str] | None = None,
) -> list[str]:
    """Publish this member's name and settings, wait for every rank's; return the names by rank.

    Args:
        conn: The World's connection.
        name: This member's name.
        rank: This member's rank.
        world_size: Number of ranks.
        timeout: Seconds to wait for the other ranks.
        settings: What must agree across members, by what it is (``"RPC backends"``) to this member's value.

    Raises:
        TimeoutError: Naming the ranks that did not arrive.
        ValueError: If two members have the same name, or the members' settings differ (naming each
            member's value); every rank raises it.
    """
    # The settings go first: a rank that sees every name sees every rank's settings.
    conn.store.set(f"world/settings/{rank}", json.dumps(dict(settings or {}), sort_keys=True))
    conn.store.set(f"world/name/{rank}", name)
    keys = [f"world/name/{r}" for r in range(world_size)]
    wait_keys(conn.store, conn.waits, keys, timeout, f"World {name!r} waiting for the other ranks")
    names = [conn.store.get(k).decode() for k in keys]
    found = [json.loads(conn.store.get(f"world/settings/{r}")) for r in range(world_size)]
    problems = _disagreements(names, found)
    if problems:
        _checked(conn, rank, world_size, timeout)
        raise ValueError("; ".join(problems))
    if rank != 0 and not conn.outlives_attempt:  # rank 0 serves the store: name its member
        conn.store.server = f"rank 0 ({names[0]!r}), which serves it"
    return names


def _disagreements(names: list[str], settings: list[dict[str, str]]) -> list[str]:
    """What the members disagree on: duplicate names, then each setting whose values differ."""
    problems = []
    unique = len(set(names)) == len(names)
    if not unique:
        problems.append(f"member names must be unique, got {names} (by rank)")
    labels = sorted({label for member in settings for label in member})
    for label in labels:
        values = {
            (n if unique else f"rank {r}"): s.get(label)
            for r, (n, s) in enumerate(zip(names, settings, strict=True))
        }
        if len(set(values.values())) > 1:
            problems.append(f"members use different {label}: {values}")
    return problems


def _checked(conn: Connection, rank: int, world_size: int, timeout: float) -> None:
    """Say this rank has read the table; the rank serving the store waits for every rank to say so.

    The serving rank's store goes away when it raises, and a rank still reading would then get a lost
    connection instead of the ``ValueError``. A rank that never says so (it died) costs at most ``timeout``.
    """
    conn.store.set(f"world/checked/{rank}", "1")
    if not conn.serves:
        return
    keys = [f"world/checked/{r}" for r in range(world_size)]
    try:
        wait_keys(conn.store, conn.waits, keys, timeout, "the ranks reading the members' settings")
    except (TimeoutError, RuntimeError, OSError) as exc:
        logger.debug("not every rank read the members' settings: %r", exc)
