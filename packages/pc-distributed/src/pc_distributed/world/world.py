"""The per-process :class:`World`: a named member of a process group and an RPC network, plus its accessors.

Construction is transactional (store, then process group, then RPC; a failure undoes what was done, in
reverse); the bounded start lives in ``_rendezvous``. :meth:`World.stop` leaves through the store within a
bound of its own: torch's store requests other than ``wait`` have no deadline, and against a store whose host
is partitioned away or frozen they would block until TCP gives up (about 15 minutes). The store (a
``TCPStore`` served by rank 0, by torchrun's agent or by :func:`~pc_distributed.run_world`) also holds the
rank/name table, the RPC groups' directories and every barrier. A TCPStore client runs one request at a time,
so the World keeps three kinds of connection to it: ``store`` for short requests (look-ups, claims,
arrivals), ``waits`` (one connection per blocking wait, see ``_store``) and one of the process group's
own; no thread's wait ever stalls another thread's request.

The World owns what lives as long as it does: its RPC agent (``rpc_agent``, the started backend its
RPC groups' calls travel on, chosen and started through ``rpc._backends`` as ``rpc_backend`` says), its RPC
groups, their tables of paired values and services (:attr:`World.rpc_tables`, what incoming calls run on)
and its collective groups. It hands itself to the groups at creation (they see it through the
``GroupHost`` protocol of ``_host`` and never import this module). Timeouts follow the package's convention
(``_checks``): ``None`` is the World's default, ``-1`` another name for it.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any, NoReturn

from pc_distributed import _torch_dist
from pc_distributed._bounded import call_bounded
from pc_distributed._checks import int_in_range, positive_seconds, resolve_timeout
from pc_distributed._host import clear_world, current_world, install_world
from pc_distributed._one_thread import OneThreadAtATime
from pc_distributed._store import BoundedStore, StoreBarrier, WaitStores
from pc_distributed.collective.group import CollectiveGroup, create_collective_group
from pc_distributed.rpc._backends import BackendSetup, RpcBackend, choose_backend, start_backend
from pc_distributed.rpc.group import ProcessTables, RpcGroup, create_rpc_group
from pc_distributed.world._env import check_name, resolve_world_spec
from pc_distributed.world._interfaces import InterfaceEnv, check_interface
from pc_distributed.world._rendezvous import Connection, connect, publish_name

__all__ = ["STOP_STORE_MARGIN", "World", "get_cur_name", "get_cur_rank", "get_world", "is_world_initialized"]

logger = logging.getLogger(__name__)

# Seconds World.stop gives its store requests beyond its own barrier timeout before it leaves without them.
STOP_STORE_MARGIN = 2.0


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
        init_rpc: Start the RPC backend (needed for RPC groups' calls).
        dist_backend: Backend of the process group (``"gloo"``, ``"nccl"``).
        dist_init_method: Init method URL of the store and process group, in torch's forms:
            ``"tcp://host:port"`` (machin's form; IPv6 hosts in brackets), ``"env://"`` (reads
            ``MASTER_ADDR``/``MASTER_PORT``) or ``"file:///path"`` (a file every rank can open). Rank 0 serves
            a ``tcp://``/``env://`` store on exactly that address unless torchrun's agent (or ``run_world``)
            already serves it. A query may carry ``rank`` and ``world_size`` (used when those arguments are
            -1). Default: ``tcp://MASTER_ADDR:MASTER_PORT`` (``addr`` before ``MASTER_ADDR``).
        rpc_init_method: Where RPC meets, same forms. TensorPipe: the World's store when omitted or naming
            the same address (the store is multi-tenant); another ``tcp://``/``env://`` address is a store of
            RPC's own, which rank 0 serves on exactly that address; a ``file://`` URL goes to torch. c10d:
            checked, then not used (its links meet on the World's store).
        dist_timeout: Seconds for the rendezvous, the store and every collective of the default group.
        rpc_timeout: Default seconds of each RPC and of :meth:`stop`.
        addr: The rendezvous address (host name or IP; default ``MASTER_ADDR``, else ``127.0.0.1``). A rank
            0 that serves the store binds exactly this address (``0.0.0.0`` only when given), never all
            interfaces by default. Not together with ``dist_init_method``.
        interface: The network interface gloo and TensorPipe use (``GLOO_SOCKET_IFNAME`` and
            ``TP_SOCKET_IFNAME`` for the World's lifetime). Default: the variables as set, else loopback when
            ``addr`` is a loopback address.
        rpc_backend: What RPC calls travel on: ``"tensorpipe"`` (``torch.distributed.rpc``), ``"c10d"`` (a
            gloo process group per pair of members, pickled with pc-pickle; never calls ``init_rpc``) or
            ``"auto"``: the ``PC_RPC_BACKEND`` environment variable if set, else ``"c10d"`` on a torch build
            without RPC, else ``"tensorpipe"`` (docs/distributed.md, "RPC backends").
        rpc_busy_poll: Let TensorPipe use its busy-polling transports (TensorPipe only).

    Raises:
        RuntimeError: If a World already exists in this process.
        TypeError: On arguments of the wrong type.
        ValueError: On out-of-range arguments, a malformed init method, duplicate member names, a
            ``dist_backend`` that is not a backend of this torch build (the message lists the ones it has),
            an ``rpc_backend`` that names none (or TensorPipe on a build without RPC), or members that differ
            in their RPC backend or process-group backend (or in ``init_rpc``/``init_dist``): every rank
            raises it, naming each member's value, before any backend starts.
        TimeoutError: If the rendezvous address is unreachable or silent, or the other ranks do not join,
            within ``dist_timeout``.
        OSError: If rank 0 cannot bind the rendezvous address (or the address of RPC's own store).

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
        *,
        addr: str | None = None,
        interface: str | None = None,
        rpc_busy_poll: bool = False,
        rpc_backend: str = "auto",
    ) -> None:
        self.name = check_name(name)
        self.dist_timeout = positive_seconds("dist_timeout", dist_timeout)
        self.rpc_timeout = positive_seconds("rpc_timeout", rpc_timeout)
        if not isinstance(dist_backend, str):
            raise TypeError(f"dist_backend must be a str, got {type(dist_backend).__name__}")
        if init_dist:
            _torch_dist.check_backend(dist_backend)
        self._interface = None if interface is None else check_interface(interface)
        self._spec = resolve_world_spec(rank, world_size, dist_init_method, rpc_init_method, addr=addr)
        self.rank = self._spec.rank
        self.world_size = self._spec.world_size
        self.dist_backend = dist_backend
        self.init_dist = bool(init_dist)
        self.init_rpc = bool(init_rpc)
        self.rpc_busy_poll = bool(rpc_busy_poll)
        self.rpc_backend = choose_backend(rpc_backend)
        # What the RPC groups' calls travel on (GroupHost.rpc_agent); set by _start when init_rpc.
        self.rpc_agent: RpcBackend | None = None
        self._rpc_groups: dict[str, RpcGroup] = {}
        self._rpc_tables = ProcessTables()
        self._rpc_instances: dict[str, int] = {}
        self._collective_groups: list[CollectiveGroup] = []
        self._lock = threading.RLock()
        self._cg_seq = 0
        self._cg_one_thread = OneThreadAtATime(f"World {name!r}")
        self._stopped = False
        self._conn: Connection | None = None
        self._names: list[str] = []
        self._rank_of: dict[str, int] = {}
        self._ifenv: InterfaceEnv | None = None
        install_world(self, self._start)

    def _start(self) -> None:
        undo: list[Any] = []
        try:
            self._ifenv = InterfaceEnv(self._interface, self._spec.on_loopback())
            undo.append(self._ifenv.restore)
            self._conn = connect(self._spec, self.name, self.rank, self.world_size, self.dist_timeout)
            undo.append(self._drop_store)
            self._names = publish_name(
                self._conn, self.name, self.rank, self.world_size, self.dist_timeout, self._settings()
            )
            self._rank_of = {n: r for r, n in enumerate(self._names)}
            if self.init_dist:
                pg_store = self._conn.pg_store(self.dist_timeout)
                _torch_dist.init_pg(
                    pg_store, self.dist_backend, self.rank, self.world_size, self.dist_timeout
                )
                undo.append(_torch_dist.destroy_pg)
            if self.init_rpc:
                self.rpc_agent = start_backend(self.rpc_backend, self._backend_setup(self._conn))
        except BaseException:
            for step in reversed(undo):
                try:
                    step()
                except Exception as exc:  # pragma: no cover - best-effort undo
                    logger.debug("undo step %r failed: %r", step, exc)
            raise

    def _backend_setup(self, conn: Connection) -> BackendSetup:
        """What the RPC backend's start gets: this member, the members, the timeouts, the meeting places."""
        return BackendSetup(
            member=self.name,
            rank=self.rank,
            world_size=self.world_size,
            names=tuple(self._names),
            timeout=self.rpc_timeout,
            start_timeout=self.dist_timeout,
            busy_poll=self.rpc_busy_poll,
            link_store=lambda: conn.link_store(self.dist_timeout),
            rpc_init_method=lambda: conn.rpc_init_method(self._spec, self.name, self.dist_timeout),
        )

    def _settings(self) -> dict[str, str]:
        """What every member must agree on, compared before anything starts (``publish_name``)."""
        return {
            "RPC backends": self.rpc_backend if self.init_rpc else "none (init_rpc=False)",
            "process-group backends": (
                self.dist_backend.replace(" ", "").lower() if self.init_dist else "none (init_dist=False)"
            ),
        }

    def _drop_store(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _connection(self) -> Connection:
        conn = self._conn
        if conn is None:
            raise RuntimeError(f"World {self.name!r} has been stopped (its store is closed)")
        return conn

    @property
    def store(self) -> BoundedStore:
        """The World's bounded shared store client (short requests; keys carry the World's prefix).

        Raises:
            RuntimeError: After :meth:`stop`.
        """
        return self._connection().store

    @property
    def waits(self) -> WaitStores:
        """The clients for blocking store waits (one connection per wait); ``RuntimeError`` after stop."""
        return self._connection().waits

    @property
    def rpc_tables(self) -> ProcessTables:
        """The paired values and services of this process's RPC groups (what incoming calls run on)."""
        return self._rpc_tables

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
            TypeError: If ``rank`` is not an int.
            ValueError: If ``rank`` is not in the world.
        """
        return str(self._names[int_in_range("rank", rank, self.world_size)])

    @property
    def groups(self) -> MappingProxyType[str, RpcGroup]:
        """The live RPC groups this process created, by name (a read-only view)."""
        return MappingProxyType(self._rpc_groups)

    @property
    def collective_groups(self) -> list[CollectiveGroup]:
        """The collective groups this process created, in creation order (a copy)."""
        return list(self._collective_groups)

    # -- what the groups use (the GroupHost protocol of _host) ---
    def next_rpc_group_instance(self, group_name: str) -> int:
        """How many RPC groups named ``group_name`` this process created before (scopes their keys)."""
        with self._lock:
            instance = self._rpc_instances.get(group_name, 0)
            self._rpc_instances[group_name] = instance + 1
            return instance

    def attach_rpc_group(self, group_name: str, group: RpcGroup) -> None:
        """Record a new live RPC group (called by ``create_rpc_group``).

        Raises:
            RuntimeError: If a live group of that name exists.
        """
        with self._lock:
            if group_name in self._rpc_groups:
                raise RuntimeError(
                    f"RpcGroup {group_name!r} already exists in this process; destroy it first"
                )
            self._rpc_groups[group_name] = group

    def detach_rpc_group(self, group_name: str, group: RpcGroup) -> None:
        """Forget the live RPC group ``group`` (called by its ``destroy``; idempotent)."""
        with self._lock:
            if self._rpc_groups.get(group_name) is group:
                del self._rpc_groups[group_name]

    def next_collective_seq(self) -> int:
        """The sequence number of the next collective group (every rank creates them in the same order)."""
        with self._lock:
            seq = self._cg_seq
            self._cg_seq += 1
            return seq

    def attach_collective_group(self, group: CollectiveGroup) -> None:
        """Record a new collective group (it is marked destroyed when the World stops)."""
        with self._lock:
            self._collective_groups.append(group)

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
            RuntimeError: If the world was created with ``init_dist=False`` or stopped, or another thread of
                this process is creating a collective group (one thread at a time: groups are numbered).
            ValueError: If ``ranks`` is invalid or the ranks disagree on it.
            TimeoutError: Naming the ranks that did not enter within ``timeout``.
        """
        self._check_alive()
        if not self.init_dist:
            raise RuntimeError("create_collective_group needs a World created with init_dist=True")
        with self._cg_one_thread("create_collective_group"):  # groups are numbered in creation order
            return create_collective_group(self, ranks, positive_seconds("timeout", timeout), backend)

    def create_rpc_group(
        self, group_name: str, members: Sequence[str], *, timeout: float | None = None
    ) -> RpcGroup:
        """Create an RPC group. Only the members call it; each waits for the others.

        Args:
            group_name: Unique name of the group.
            members: Member names; must include this process.
            timeout: Seconds to wait for the other members (None or -1: ``rpc_timeout``).

        Returns:
            The :class:`~pc_distributed.RpcGroup`.

        Raises:
            RuntimeError: If RPC is not initialised, or a group of that name exists in this process.
            ValueError: If ``members`` is invalid, lacks this process, or the members disagree on it.
            TimeoutError: Naming the members that did not join.
        """
        self._check_alive()
        return create_rpc_group(self, group_name, members, resolve_timeout(timeout, self.rpc_timeout))

    def get_rpc_group(self, group_name: str) -> RpcGroup | None:
        """The live RPC group of that name created by this process, or None."""
        return self._rpc_groups.get(group_name)

    # -- shutdown ---
    def stop(self, timeout: float | None = None, graceful: bool = True) -> None:
        """Leave the world: destroy RPC groups, shut RPC down, destroy process groups, clear the singleton.

        Idempotent and bounded: the store part (the RPC groups' directory entries and the barrier that
        meets the other ranks) gets ``timeout`` plus ``STOP_STORE_MARGIN`` seconds, after which a store that
        does not answer (its host partitioned away, frozen or dead) is left behind with a ``RuntimeWarning``;
        RPC's shutdown always has a timeout (a dead peer must not hang it); a failed graceful shutdown warns
        and falls back to a non-graceful one. docs/reliability.md has the bounds across hosts.
        Afterwards a new World may be created. While it waits for the other ranks, this process's other
        threads can still look up and call services (through group handles) and answer RPCs: the wait has a
        store connection of its own.

        A service may stop its own World (from inside its handler): with ``graceful=False`` it leaves at once
        on c10d; on TensorPipe torch's RPC shutdown waits for that very handler, so it is given ``timeout``
        and then left to end in the background once the handler returns (a ``RuntimeWarning``). Either way
        the handler's caller gets ``ConnectionError`` naming the member. A graceful stop there waits at the
        barrier for the caller, which waits for the handler, until the call times out.

        Args:
            timeout: Seconds for the barrier and the RPC shutdown (None or -1: ``rpc_timeout``).
            graceful: Wait for the peers' outstanding work (all ranks must call stop), else leave at once.
        """
        timeout = resolve_timeout(timeout, self.rpc_timeout)
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            groups = list(self._rpc_groups.values())
        try:
            graceful = self._leave_store(groups, timeout, graceful)
            if self.rpc_agent is not None:
                self.rpc_agent.shutdown(graceful, timeout)
            if self.init_dist:
                for cg in self._collective_groups:
                    cg._forget()
                _torch_dist.destroy_pg()
        finally:
            self._drop_store()
            if self._ifenv is not None:
                self._ifenv.restore()
            clear_world(self)

    def _leave_store(self, groups: list[RpcGroup], timeout: float, graceful: bool) -> bool:
        """Destroy the RPC groups, then (with RPC) meet every rank; return whether RPC may stop gracefully.

        Bounded as a whole by ``timeout + STOP_STORE_MARGIN`` (:func:`~pc_distributed._bounded.call_bounded`):
        a store that does not answer is left behind with a ``RuntimeWarning`` and RPC then shuts down
        non-gracefully.
        """

        def run() -> bool:
            for group in groups:
                try:
                    group.destroy()
                except Exception as exc:
                    logger.debug("destroying RPC group %r failed: %r", group.get_group_name(), exc)
            if not self.init_rpc:
                return graceful
            return self._stop_barrier(timeout, wait=graceful)

        try:
            return call_bounded(run, timeout + STOP_STORE_MARGIN, f"World.stop of {self.name!r}: the store")
        except TimeoutError as exc:
            warnings.warn(
                f"{exc}; leaving without it (RPC shuts down non-gracefully)", RuntimeWarning, stacklevel=3
            )
            return False

    def _stop_barrier(self, timeout: float, wait: bool) -> bool:
        """Meet every rank in ``stop`` through the store; return whether RPC may stop gracefully.

        torch's graceful shutdown waits for a dead peer with the store's timeout, not the one passed to it;
        this barrier notices a missing rank within ``timeout`` instead. A rank that leaves non-gracefully
        (``wait`` is False) still arrives, and marks the stop as abandoned so that the others do not wait for
        it in torch's shutdown either.
        """
        conn = self._connection()
        store = conn.store
        try:
            if not wait:
                store.set("world/stop_abandoned", self.name)
            barrier = StoreBarrier(store, conn.waits, "world/stop", self.name, self._names)
            barrier.enter(0, timeout, wait=wait)
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

    def __reduce__(self) -> NoReturn:
        raise TypeError("World is a per-process object and cannot be pickled or sent to another process")

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else "running"
        return f"World(name={self.name!r}, rank={self.rank}, world_size={self.world_size}, {state})"


def get_world() -> World | None:
    """This process's World, or None before one is created (or after it stopped)."""
    world: World | None = current_world()
    return world


def is_world_initialized() -> bool:
    """Whether this process has a running World."""
    return current_world() is not None


def _require_world() -> World:
    world: World | None = current_world()
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
