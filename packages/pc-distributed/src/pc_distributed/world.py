"""The per-process :class:`World`: a named member of a process group and an RPC network, plus its accessors.

Construction is transactional (store, then process group, then RPC; a failure undoes what was done, in
reverse). The store (a ``TCPStore`` served by rank 0, by torchrun's agent or by
:func:`~pc_distributed.run_world`) also holds the rank/name table, the RPC groups' directories and every
barrier. A TCPStore client runs one request at a time, so the World keeps three kinds of connection to it:
``store`` for short requests (look-ups, claims, arrivals), ``waits`` (one connection per blocking wait, see
``_store_waits``) and one of the process group's own; no thread's wait ever stalls another thread's request.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from pc_distributed import _torch_dist
from pc_distributed._bounded import BoundedStore, call_bounded
from pc_distributed._env import WorldSpec, check_name, resolve_world_spec
from pc_distributed._store import store_barrier, wait_keys
from pc_distributed._store_waits import WaitStores

if TYPE_CHECKING:
    from pc_distributed.collective import CollectiveGroup
    from pc_distributed.rpc_group import RpcGroup

__all__ = ["World", "get_cur_name", "get_cur_rank", "get_world", "is_world_initialized"]

logger = logging.getLogger(__name__)

_WORLD: World | None = None
_WORLD_LOCK = threading.Lock()
_PREFIX = "pc_distributed"
_EPOCH = 0
# Seconds World.stop gives its store requests beyond its own barrier timeout before it leaves without them.
STOP_STORE_MARGIN = 2.0


def _next_epoch() -> int:
    global _EPOCH
    _EPOCH += 1
    return _EPOCH


def _positive(label: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{label} must be a number of seconds, got {type(value).__name__} {value!r}")
    if not value > 0:
        raise ValueError(f"{label} must be > 0 seconds, got {value!r}")
    return float(value)


class World:
    """This process's membership in a world of ``world_size`` processes (a class and a per-process singleton).

    Rank, size and the rendezvous address default from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``), else to a one-process world on a free loopback port. Every rank of the
    world must construct its World (and later call :meth:`stop`). A second World in one process raises until
    the first is stopped.

    Args:
        name: This member's unique name (letters, digits, ``_``, ``:``, ``-``).
        rank: This process's rank (-1: from ``RANK``, else 0).
        world_size: Number of processes (-1: from ``WORLD_SIZE``, else 1).
        init_dist: Create the default torch.distributed process group (needed for collective groups).
        init_rpc: Initialise torch.distributed.rpc (needed for RPC groups' calls).
        dist_backend: Backend of the process group (``"gloo"``, ``"nccl"``).
        dist_init_method: Init method URL of the store and process group (default
            ``tcp://MASTER_ADDR:MASTER_PORT``).
        rpc_init_method: Init method URL of RPC (default: the same store, which is multi-tenant).
        dist_timeout: Seconds for the rendezvous, the store and every collective of the default group.
        rpc_timeout: Default seconds of each RPC and of :meth:`stop`.

    Raises:
        RuntimeError: If a World already exists in this process.
        TypeError: On arguments of the wrong type.
        ValueError: On out-of-range arguments or duplicate member names.
        TimeoutError: If the other ranks do not join within ``dist_timeout``.

    Examples:
        >>> world = World(name="0")  # a one-process world on a free loopback port
        >>> world.get_members()
        ['0']
        >>> world.stop()
    """

    def __init__(
        self,
        name: str,
        rank: int = -1,
        world_size: int = -1,
        init_dist: bool = True,
        init_rpc: bool = True,
        dist_backend: str = "gloo",
        dist_init_method: str | None = None,
        rpc_init_method: str | None = None,
        dist_timeout: float = 60,
        rpc_timeout: float = 60,
    ) -> None:
        global _WORLD
        self.name = check_name(name)
        self.dist_timeout = _positive("dist_timeout", dist_timeout)
        self.rpc_timeout = _positive("rpc_timeout", rpc_timeout)
        if not isinstance(dist_backend, str):
            raise TypeError(f"dist_backend must be a str, got {type(dist_backend).__name__}")
        spec = resolve_world_spec(rank, world_size, dist_init_method, rpc_init_method)
        self.rank = spec.rank
        self.world_size = spec.world_size
        self.dist_backend = dist_backend
        self.init_dist = bool(init_dist)
        self.init_rpc = bool(init_rpc)
        self.groups: dict[str, RpcGroup] = {}
        self.collective_groups: list[CollectiveGroup] = []
        self._lock = threading.RLock()
        self._cg_seq = 0
        self._stopped = False
        with _WORLD_LOCK:
            if _WORLD is not None:
                raise RuntimeError("World could only be initialized once!")
            self._start(spec)
            _WORLD = self

    def _start(self, spec: WorldSpec) -> None:
        undo: list[Any] = []
        try:
            if spec.serves_loopback():
                host = "127.0.0.1" if spec.host in (None, "localhost") else str(spec.host)
                raw = _torch_dist.master_store(host, spec.port or 0, self.world_size, self.dist_timeout)
            else:
                # torch's client waits for the server's handshake with no deadline: a rendezvous address that
                # accepts connections and never answers (a frozen rank 0) would block here forever.
                raw = call_bounded(
                    lambda: _torch_dist.open_store(
                        spec.dist_url, self.rank, self.world_size, self.dist_timeout
                    ),
                    self.dist_timeout,
                    f"World {self.name!r}: the rendezvous store at {spec.dist_url}",
                )
            self._raw_store = raw
            undo.append(self._drop_store)
            # Keys are scoped per torchrun restart and per World of this process (every rank creates its
            # Worlds in the same order), so a store that outlives a World never shows it stale keys. Only an
            # agent's store outlives the workers; a store served by rank 0 is new in every attempt (and the
            # hosts' restart counts can differ: a c10d agent restarting for a membership change counts none).
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if spec.agent_store else "0"
            prefix = f"{_PREFIX}/{restart}/{_next_epoch()}"
            # Every short request of the World's shared client is bounded by dist_timeout (torch's are not).
            self.store = BoundedStore(
                _torch_dist.prefix_store(prefix, raw), self.dist_timeout, f"the store of World {self.name!r}"
            )
            self.waits = WaitStores(raw, prefix, self.dist_timeout)
            rpc_url = spec.rpc_url
            port = _torch_dist.store_port(raw)
            if rpc_url.endswith(":0") and port is not None:
                rpc_url = f"{rpc_url[:-2]}:{port}"
            self._publish_name()
            if self.init_dist:
                # The process group's store waits (gloo's rendezvous of every new group) get their own client.
                pg_store = _torch_dist.store_client(raw, self.dist_timeout) or raw
                if spec.agent_store:  # torchrun's store outlives a restart: scope the group's keys to it
                    pg_store = _torch_dist.prefix_store(f"{prefix}/pg", pg_store)
                _torch_dist.init_pg(
                    pg_store, self.dist_backend, self.rank, self.world_size, self.dist_timeout
                )
                undo.append(_torch_dist.destroy_pg)
            if self.init_rpc:
                if spec.agent_store and rpc_url == spec.dist_url:
                    # RPC on torchrun's store, which outlives a restart: its keys scoped to this attempt too
                    # (else a restarted worker reads the dead attempt's addresses and cannot connect).
                    client = _torch_dist.store_client(raw, self.dist_timeout)
                    if client is not None:
                        scoped = _torch_dist.prefix_store(f"{prefix}/rpc", client)
                        rpc_url = _torch_dist.rpc_url_for_store(scoped)
                _torch_dist.start_rpc(self.name, self.rank, self.world_size, rpc_url, self.rpc_timeout)
        except BaseException:
            for step in reversed(undo):
                try:
                    step()
                except Exception as exc:  # pragma: no cover - best-effort undo
                    logger.debug("undo step %r failed: %r", step, exc)
            raise

    def _publish_name(self) -> None:
        self.store.set(f"world/name/{self.rank}", self.name)
        keys = [f"world/name/{r}" for r in range(self.world_size)]
        wait_keys(
            self.store,
            self.waits,
            keys,
            self.dist_timeout,
            f"World {self.name!r} waiting for the other ranks",
        )
        names = [self.store.get(k).decode() for k in keys]
        if len(set(names)) != len(names):
            raise ValueError(f"member names must be unique, got {names} (by rank)")
        self._names = names
        self._rank_of = {n: r for r, n in enumerate(names)}

    def _drop_store(self) -> None:
        waits = self.__dict__.pop("waits", None)
        if waits is not None:
            waits.close()
        store = self.__dict__.pop("store", None)
        if store is not None:
            store.close()
        self.__dict__.pop("_raw_store", None)

    # -- accessors ---
    def get_ranks(self) -> list[int]:
        """All ranks of the world, sorted."""
        return list(range(self.world_size))

    def get_members(self) -> list[str]:
        """All member names of the world, sorted."""
        return sorted(self._names)

    def rank_of(self, name: str) -> int:
        """The rank of member ``name``.

        Raises:
            ValueError: If no member has that name.
        """
        try:
            return self._rank_of[name]
        except KeyError:
            raise ValueError(f"no member named {name!r}; members are {self.get_members()}") from None

    def name_of(self, rank: int) -> str:
        """The member name of ``rank``.

        Raises:
            ValueError: If ``rank`` is not in the world.
        """
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")
        return str(self._names[rank])

    def _check_alive(self) -> None:
        if self._stopped:
            raise RuntimeError(f"World {self.name!r} has been stopped")

    # -- groups ---
    def create_collective_group(
        self, ranks: Sequence[int], timeout: float = 60, backend: str | None = None
    ) -> CollectiveGroup:
        """Create a collective group over ``ranks``; **every world rank must call it**, in the same order.

        This is torch's ``new_group`` rule; a rank outside ``ranks`` gets a group whose methods raise. Before
        creating the group the ranks check through the store that they all entered with the same ranks.

        Args:
            ranks: Global ranks of the members.
            timeout: Seconds for the check and for every collective of the group.
            backend: Backend (default: the world's).

        Returns:
            The :class:`~pc_distributed.CollectiveGroup`.

        Raises:
            RuntimeError: If the world was created with ``init_dist=False`` or stopped.
            ValueError: If ``ranks`` is invalid or the ranks disagree on it.
            TimeoutError: Naming the ranks that did not enter within ``timeout``.
        """
        from pc_distributed.collective import create_collective_group

        self._check_alive()
        if not self.init_dist:
            raise RuntimeError("create_collective_group needs a World created with init_dist=True")
        return create_collective_group(self, ranks, _positive("timeout", timeout), backend)

    def create_rpc_group(
        self, group_name: str, members: Sequence[str], *, timeout: float | None = None
    ) -> RpcGroup:
        """Create an RPC group. Only the members call it; each waits for the others.

        Args:
            group_name: Unique name of the group.
            members: Member names; must include this process.
            timeout: Seconds to wait for the other members (default ``rpc_timeout``).

        Returns:
            The :class:`~pc_distributed.RpcGroup`.

        Raises:
            RuntimeError: If RPC is not initialised, or a group of that name exists in this process.
            ValueError: If ``members`` is invalid, lacks this process, or the members disagree on it.
            TimeoutError: Naming the members that did not join.
        """
        from pc_distributed.rpc_group import create_rpc_group

        self._check_alive()
        return create_rpc_group(
            self, group_name, members, self.rpc_timeout if timeout is None else _positive("timeout", timeout)
        )

    def get_rpc_group(self, group_name: str) -> RpcGroup | None:
        """The live RPC group of that name created by this process, or None."""
        return self.groups.get(group_name)

    # -- shutdown ---
    def stop(self, timeout: float | None = None, graceful: bool = True) -> None:
        """Leave the world: destroy RPC groups, shut RPC down, destroy process groups, clear the singleton.

        Idempotent and bounded: the store part (the RPC groups' directory entries and the barrier that
        meets the other ranks) gets ``timeout`` plus ``STOP_STORE_MARGIN`` seconds, after which a store that
        does not answer (its host partitioned away, frozen or dead) is left behind with a ``RuntimeWarning``;
        RPC's shutdown always has a timeout (a dead peer must not hang it); a failed graceful shutdown warns
        and falls back to a non-graceful one. docs/reliability.md has the measured bounds across hosts.
        Afterwards a new World may be created. While it waits for the other ranks, this process's other
        threads can still look up and call services (through group handles) and answer RPCs: the wait has a
        store connection of its own.

        Args:
            timeout: Seconds for the RPC shutdown (default ``rpc_timeout``).
            graceful: Wait for the peers' outstanding work (all ranks must call stop), else leave at once.
        """
        global _WORLD
        timeout = self.rpc_timeout if timeout is None else _positive("timeout", timeout)
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        try:
            # torch's store requests other than wait have no deadline of their own: when the store's host is
            # partitioned away or frozen they would block until TCP gives up (~15 min), so the store part of
            # stop runs bounded, and a store that does not answer is left behind (RPC then stops at once).
            try:
                graceful = call_bounded(
                    lambda: self._leave_store(timeout, graceful),
                    timeout + STOP_STORE_MARGIN,
                    f"World.stop of {self.name!r}: the store",
                )
            except TimeoutError as exc:
                warnings.warn(
                    f"{exc}; leaving without it (RPC shuts down non-gracefully)", RuntimeWarning, stacklevel=2
                )
                graceful = False
            if self.init_rpc:
                _torch_dist.shutdown_rpc(graceful, timeout)
            if self.init_dist:
                for cg in self.collective_groups:
                    cg._forget()
                _torch_dist.destroy_pg()
        finally:
            self._drop_store()
            with _WORLD_LOCK:
                if _WORLD is self:
                    _WORLD = None

    def _leave_store(self, timeout: float, graceful: bool) -> bool:
        """The store part of :meth:`stop`: drop the RPC groups' entries, meet the others; may RPC wait?"""
        for group in list(self.groups.values()):
            try:
                group.destroy()
            except Exception as exc:
                logger.debug("destroying RPC group %r failed: %r", group.get_group_name(), exc)
        if not self.init_rpc:
            return graceful
        return self._stop_barrier(timeout, wait=graceful)

    def _stop_barrier(self, timeout: float, wait: bool) -> bool:
        """Meet every rank in ``stop`` through the store (bounded); return whether RPC may stop gracefully.

        torch's graceful shutdown waits for a dead peer with the store's timeout, not the one passed to it;
        our barrier notices a missing rank within ``timeout`` instead. A rank that leaves non-gracefully
        (``wait`` is False) still arrives, and marks the stop as abandoned so that the others do not wait for
        it in torch's shutdown either.
        """
        try:
            if not wait:
                self.store.set("world/stop_abandoned", self.name)
            store_barrier(self.store, self.waits, "world/stop", 0, self.name, self._names, timeout, wait=wait)
            if wait and self.store.check(["world/stop_abandoned"]):
                logger.info("World.stop: a rank left non-gracefully; shutting RPC down non-gracefully")
                return False
            return wait
        except (TimeoutError, RuntimeError, OSError) as exc:
            if wait:
                warnings.warn(
                    f"World.stop: {exc}; shutting RPC down non-gracefully", RuntimeWarning, stacklevel=2
                )
            return False

    def __reduce__(self) -> NoReturn:
        raise TypeError("World is a per-process object and cannot be pickled or sent to another process")

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else "running"
        return f"World(name={self.name!r}, rank={self.rank}, world_size={self.world_size}, {state})"


def get_world() -> World | None:
    """This process's World, or None before one is created (or after it stopped)."""
    return _WORLD


def is_world_initialized() -> bool:
    """Whether this process has a running World."""
    return _WORLD is not None


def _require_world() -> World:
    world = _WORLD
    if world is None:
        raise RuntimeError("no World in this process: create pc_distributed.World(...) first")
    return world


def get_cur_rank() -> int:
    """This process's rank.

    Raises:
        RuntimeError: If there is no World.
    """
    return _require_world().rank


def get_cur_name() -> str:
    """This process's member name.

    Raises:
        RuntimeError: If there is no World.
    """
    return _require_world().name
