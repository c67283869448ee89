"""The ordered server: a versioned key-value store with compare-and-set, served over an RpcGroup.

::

    client process                         serving process (OrderedServerSimpleImpl)
    --------------                         -----------------------------------------
    OrderedServerSimple.push  --1 RPC-->   <name>/_push_service  -> VersionedStore.push (CAS under a lock)
    OrderedServerSimple.pull  --1 RPC-->   <name>/_pull_service  -> VersionedStore.pull
                                           the reply is serialised: the client gets a snapshot
    accessor in the serving process   -->  the same services, run by RpcGroup without an RPC
                                           (on copies both ways, as an RPC would deliver them)

The accessor is a picklable pair ``(server_name, group)``; the Impl pairs one under ``server_name`` so clients
can fetch it with ``group.get_paired(server_name).to_here()``.
"""

from __future__ import annotations

import abc
import logging
from typing import Any

from pc_server._checkpoint import check_state, header
from pc_server._copy import snapshot
from pc_server._group import GroupLike, call_service, check_group, check_name
from pc_server._versioned import PullResult, PushResult, VersionedStore

__all__ = ["OrderedServerBase", "OrderedServerSimple", "OrderedServerSimpleImpl"]

logger = logging.getLogger(__name__)


class OrderedServerBase(abc.ABC):
    """The contract of an ordered key-value server.

    Descendants do not have to guarantee strong consistency: even an acknowledged push may later be lost (for
    example when the serving process dies, since the state lives in its memory only).
    """

    @abc.abstractmethod
    def push(self, key: Any, value: Any, version: Any, prev_version: Any) -> bool:
        """Push a new ``version`` of ``value`` under ``key`` if the newest stored version is ``prev_version``.

        Note:
            If ``version == prev_version`` the newest entry is overwritten in place and there is no order
            guarantee; you may exploit this.

        Args:
            key: Key.
            value: Value.
            version: New version.
            prev_version: The version the caller believes is the newest.

        Returns:
            ``True`` if the push succeeded, ``False`` if not.
        """

    @abc.abstractmethod
    def pull(self, key: Any, version: Any = None) -> tuple[Any, Any] | None:
        """Pull the value of ``key`` at ``version``.

        Args:
            key: Key.
            version: Target version; ``None`` pulls the newest.

        Returns:
            ``(value, version)``, or ``None`` if the key or the version is not stored (or was trimmed).
        """


_ORDERED_FORMAT = "pc_server.OrderedServerSimpleImpl"


def _service_names(server_name: str) -> tuple[str, str, str]:
    return (
        f"{server_name}/_push_service",
        f"{server_name}/_pull_service",
        f"{server_name}/_pull_if_newer_service",
    )


class OrderedServerSimple(OrderedServerBase):
    """Accessor to an :class:`OrderedServerSimpleImpl`; ``push`` and ``pull`` are one RPC each.

    In the server's own process the group runs the service without an RPC to the process itself, on the
    copies an RPC would make (``RpcGroup.registered_sync``).

    Get it with ``group.get_paired(server_name).to_here()`` or build it directly; it is picklable. Safe to
    share between threads: it holds only the server's name and group.

    Args:
        server_name: The name the Impl was created with.
        group: The RpcGroup the Impl serves in.

    Examples:
        >>> server = group.get_paired("kv").to_here()  # doctest: +SKIP
        >>> server.push("a", torch.zeros(3), version=1, prev_version=None)  # doctest: +SKIP
        True
        >>> server.pull("a")  # doctest: +SKIP
        (tensor([0., 0., 0.]), 1)
    """

    def __init__(self, server_name: str, group: GroupLike) -> None:
        self.server_name = check_name("server_name", server_name)
        self.group = check_group(group)
        self._push_key, self._pull_key, self._pull_newer_key = _service_names(server_name)

    def __repr__(self) -> str:
        return f"OrderedServerSimple(server_name={self.server_name!r})"

    def push(self, key: Any, value: Any, version: Any, prev_version: Any) -> bool:
        """Compare-and-set push (see :meth:`OrderedServerBase.push`); one RPC (none in the server's process).

        Raises:
            ConnectionError: The serving process is unreachable.
            TimeoutError: It did not answer within the RPC timeout.
            TypeError: ``key`` or ``version`` is not hashable.
            ValueError: ``version`` is ``None``.
        """
        result = self.push_service_call(key, value, version, prev_version, want_newest=False)
        return result.accepted

    def push_service_call(
        self, key: Any, value: Any, version: Any, prev_version: Any, *, want_newest: bool = False
    ) -> PushResult:
        """Push and return the full :class:`~pc_server._versioned.PushResult` in one RPC.

        With ``want_newest`` a refused push also carries the newest ``(value, version)``, so "push, and pull
        on failure" costs one round trip.

        Args:
            key: Key.
            value: Value.
            version: New version.
            prev_version: Expected newest version.
            want_newest: Return the newest entry when the push is refused.

        Returns:
            ``(accepted, head, newest)``.
        """
        reply = call_service(
            self.group, self._push_key, (key, value, version, prev_version, want_newest), self.server_name
        )
        return PushResult(*reply)

    def pull(self, key: Any, version: Any = None) -> tuple[Any, Any] | None:
        """Pull a snapshot of ``key`` (see :meth:`OrderedServerBase.pull`); one RPC.

        Raises:
            ConnectionError: The serving process is unreachable.
            TimeoutError: It did not answer within the RPC timeout.
        """
        reply = call_service(self.group, self._pull_key, (key, version), self.server_name)
        return None if reply is None else (reply[0], reply[1])

    def pull_if_newer(self, key: Any, known_version: Any) -> PullResult | None:
        """Pull the newest value only if it is newer than ``known_version``; one RPC, no value sent otherwise.

        Args:
            key: Key.
            known_version: The version the caller already holds, or ``None``.

        Returns:
            ``None`` if the key is absent, else ``(fresh, value, version)`` with ``value=None`` when not
            fresh.
        """
        reply = call_service(self.group, self._pull_newer_key, (key, known_version), self.server_name)
        return None if reply is None else PullResult(*reply)


class OrderedServerSimpleImpl:
    """A versioned key-value server with strictly ordered (compare-and-set) updates.

    Create it on the serving process only, which must be a member of ``group``. It registers
    ``<server_name>/_push_service`` and ``<server_name>/_pull_service`` and pairs an
    :class:`OrderedServerSimple` accessor under ``server_name``.

    Semantics: the first push of a key always succeeds; later pushes succeed iff ``prev_version`` equals the
    newest version; ``version == prev_version`` overwrites the newest entry; re-using a version that is still
    stored is refused; at most ``version_depth`` versions per key are kept (1 keeps only the newest). Pulls
    are snapshots. State lives in this process's memory only. Safe to share between threads: every
    compare-and-set, pull and content swap is one step under the store's lock.

    Args:
        server_name: Name of this server, used to pair the accessor in ``group``.
        group: The RpcGroup where the server lives.
        version_depth: How many versions of each key are kept, the newest included.

    Raises:
        TypeError: Wrong argument types (unknown keyword arguments are a ``TypeError`` too).
        ValueError: An empty name or ``version_depth < 1``.
    """

    def __init__(self, server_name: str, group: GroupLike, version_depth: int = 1) -> None:
        self.server_name = check_name("server_name", server_name)
        self.group = check_group(group)
        self._store = VersionedStore(version_depth)
        push_key, pull_key, pull_newer_key = _service_names(server_name)
        group.register(push_key, self._push_service)
        group.register(pull_key, self._pull_service)
        group.register(pull_newer_key, self._pull_if_newer_service)
        group.pair(server_name, OrderedServerSimple(server_name, group))
        logger.debug("ordered server %r serving on %r", server_name, group.get_cur_name())

    @property
    def version_depth(self) -> int:
        """How many versions of each key are kept."""
        return self._store.version_depth

    def accessor(self) -> OrderedServerSimple:
        """A local accessor to this server (no RPC needed to obtain it)."""
        return OrderedServerSimple(self.server_name, self.group)

    # In-process API: copies are taken outside the store's lock.
    def push(self, key: Any, value: Any, version: Any, prev_version: Any) -> bool:
        """Push from the serving process itself; ``value`` is snapshotted before the compare-and-set.

        Args:
            key: Key.
            value: Value (copied; later mutation does not affect the stored entry).
            version: New version.
            prev_version: Expected newest version.

        Returns:
            Whether the push was accepted.
        """
        return self._store.push(key, snapshot(value), version, prev_version).accepted

    def push_result(
        self, key: Any, value: Any, version: Any, prev_version: Any, *, want_newest: bool = False
    ) -> PushResult:
        """:meth:`push` from the serving process, returning what the accessor's ``push_service_call`` returns.

        The value is copied before the compare-and-set; the newest entry of a refused push is a snapshot.

        Args:
            key: Key.
            value: Value (copied before the compare-and-set).
            version: New version.
            prev_version: Expected newest version.
            want_newest: Return a snapshot of the newest entry when the push is refused.

        Returns:
            ``(accepted, head, newest)``.
        """
        result = self._store.push(key, snapshot(value), version, prev_version, want_newest=want_newest)
        if result.newest is None:
            return result
        return result._replace(newest=(snapshot(result.newest[0]), result.newest[1]))

    def pull_if_newer(self, key: Any, known_version: Any) -> PullResult | None:
        """The accessor's :meth:`~OrderedServerSimple.pull_if_newer` in the serving process (a snapshot).

        Args:
            key: Key.
            known_version: The version the caller already holds, or ``None``.

        Returns:
            ``None`` if the key is absent, else ``(fresh, value, version)`` with ``value=None`` when not
            fresh.
        """
        result = self._store.pull_if_newer(key, known_version)
        if result is None or not result.fresh:
            return result
        return result._replace(value=snapshot(result.value))

    def push_snapshot(self, key: Any, value: Any, version: Any, prev_version: Any) -> bool:
        """Push from the serving process a value that is already a private snapshot (stored as is, no copy).

        For a caller that built ``value`` for this push alone and never touches it again (e.g. the gradient
        server publishing a fresh CPU snapshot of its model); anything else must use :meth:`push`.

        Args:
            key: Key.
            value: The snapshot; the store keeps this very object.
            version: New version.
            prev_version: Expected newest version.

        Returns:
            Whether the push was accepted.
        """
        return self._store.push(key, value, version, prev_version).accepted

    def pull(self, key: Any, version: Any = None) -> tuple[Any, Any] | None:
        """Pull a snapshot from the serving process itself (the copy is taken after the lock is released).

        Args:
            key: Key.
            version: Target version, or ``None`` for the newest.

        Returns:
            ``(value, version)`` or ``None``.
        """
        found = self._store.pull(key, version)
        return None if found is None else (snapshot(found[0]), found[1])

    def peek(self, key: Any, version: Any = None) -> tuple[Any, Any] | None:
        """The stored entry itself, not a copy (to inspect what the server holds; never mutate it).

        Args:
            key: Key.
            version: Target version, or ``None`` for the newest.

        Returns:
            ``(stored value, version)`` or ``None``.
        """
        return self._store.pull(key, version)

    def state_dict(self) -> dict[str, Any]:
        """A checkpoint of every key with all its retained versions (private copies), for ``torch.save``.

        Safe while the server is serving: the content is read in one step under the store's lock.

        Returns:
            ``{"format", "format_version", "server_name", "version_depth", "entries"}`` with ``entries``
            ``{key: [(version, value), ...]}``, oldest first.
        """
        entries = self._store.entries()
        return {
            **header(_ORDERED_FORMAT),
            "server_name": self.server_name,
            "version_depth": self.version_depth,
            "entries": {key: [(v, snapshot(value)) for v, value in chain] for key, chain in entries.items()},
        }

    def load_state_dict(self, state: Any) -> None:
        """Replace the whole content with a checkpoint from :meth:`state_dict` (any server name).

        Well defined while serving: the content is swapped in one step, so a concurrent push or pull sees
        either the old or the loaded content, and a compare-and-set push afterwards must name the loaded
        head. A key with more versions than this server's ``version_depth`` keeps its newest ones.

        Args:
            state: The checkpoint.

        Raises:
            TypeError: ``state`` is not a dict, or a key or version is not hashable.
            ValueError: Another server's checkpoint or a malformed entry (named in the message).
        """
        entries = check_state(state, _ORDERED_FORMAT, ("entries",))["entries"]
        if not isinstance(entries, dict):
            raise ValueError(f"ordered server state_dict entry 'entries' must be a dict, got {entries!r}")
        chains: dict[Any, list[tuple[Any, Any]]] = {}
        for key, chain in entries.items():
            if not isinstance(chain, (list, tuple)) or not all(
                isinstance(item, (list, tuple)) and len(item) == 2 for item in chain
            ):
                raise ValueError(f"ordered server state_dict: key {key!r} must map to [(version, value)]")
            chains[key] = [(v, snapshot(value)) for v, value in chain]
        self._store.replace_entries(chains)

    # Services: arguments arrive freshly deserialised and replies are serialised, so no copies are needed.
    def _push_service(
        self, key: Any, value: Any, version: Any, prev_version: Any, want_newest: bool = False
    ) -> tuple[bool, Any, tuple[Any, Any] | None]:
        result = self._store.push(key, value, version, prev_version, want_newest=want_newest)
        logger.debug(
            "ordered server %r push %r v=%r prev=%r -> %s",
            self.server_name,
            key,
            version,
            prev_version,
            result.accepted,
        )
        return result.accepted, result.head, result.newest

    def _pull_service(self, key: Any, version: Any = None) -> tuple[Any, Any] | None:
        found = self._store.pull(key, version)
        logger.debug(
            "ordered server %r pull %r v=%r -> %s", self.server_name, key, version, found is not None
        )
        return found

    def _pull_if_newer_service(self, key: Any, known_version: Any) -> tuple[bool, Any, Any] | None:
        result = self._store.pull_if_newer(key, known_version)
        return None if result is None else (result.fresh, result.value, result.version)
