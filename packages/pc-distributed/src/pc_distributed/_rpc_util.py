"""Helpers of RpcGroup: argument checks, transport-error mapping and the join handshake of a new group.

Plain functions over plain data, kept apart from the RpcGroup class so that it holds only the public surface.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pc_distributed._remote import SERVICE, VALUE, GroupTables
from pc_distributed._store import claim, release, wait_keys

if TYPE_CHECKING:
    from pc_distributed.world import World

__all__ = [
    "SERVICE",
    "VALUE",
    "chain_future",
    "check_call_args",
    "check_timeout",
    "claim_entry",
    "join_group",
    "release_entry",
    "transport_error",
    "with_cause",
]

_CONNECTION_WORDS = (
    "connection",
    "pipe",
    "eof",
    "closed",
    "reset",
    "shut",
    "refused",
    "unreachable",
    "broken",
)


def transport_error(exc: BaseException, target: str, what: str) -> BaseException:
    """Map a torch RPC transport failure to ``TimeoutError``/``ConnectionError`` naming the target."""
    text = str(exc)
    low = text.lower()
    if "timeout" in low or "timed out" in low:
        return TimeoutError(f"{what} to {target!r} timed out: {text}")
    if any(word in low for word in _CONNECTION_WORDS):
        return ConnectionError(f"{what} to {target!r} failed: {text}")
    return RuntimeError(f"{what} to {target!r} failed: {text}")


def check_timeout(timeout: object) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__} {timeout!r}")
    if timeout != -1 and not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds or -1 (the world's rpc_timeout), got {timeout!r}")
    return float(timeout)


def check_call_args(args: object, kwargs: object) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict or None, got {type(kwargs).__name__}")
    return tuple(args), dict(kwargs or {})


def with_cause(exc: BaseException, cause: BaseException) -> BaseException:
    exc.__cause__ = cause
    return exc


def join_group(
    world: World, group_name: str, members: Sequence[str], timeout: float
) -> tuple[list[str], int]:
    """Validate the members and wait (through the store) until all joined with the same member list.

    Returns:
        The sorted member names and this process's instance number of the group name.

    Raises:
        TypeError: On a wrong type.
        ValueError: On invalid members, or members that disagree.
        RuntimeError: If the group already exists in this process.
        TimeoutError: Naming the members that did not join.
    """
    if not isinstance(group_name, str) or not group_name:
        raise TypeError(f"group_name must be a non-empty str, got {group_name!r}")
    if isinstance(members, (str, bytes)) or not isinstance(members, Sequence):
        raise TypeError(
            f"members must be a sequence of member names, got {type(members).__name__} {members!r}"
        )
    names = sorted(members)
    if not names or len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"members must be non-empty, unique member names, got {list(members)}")
    unknown = [n for n in names if n not in world.get_members()]
    if unknown:
        raise ValueError(f"members {unknown} are not in the world {world.get_members()}")
    if world.name not in names:
        raise ValueError(f"create_rpc_group is called by members only; {world.name!r} is not in {names}")
    if group_name in world.groups:
        raise RuntimeError(f"RpcGroup {group_name!r} already exists in this process; destroy it first")
    counts: dict[str, int] = world.__dict__.setdefault("_rg_count", {})
    instance = counts.get(group_name, 0)
    counts[group_name] = instance + 1
    prefix = f"rg/{group_name}/{instance}/join"
    text = ",".join(names)
    world.store.set(f"{prefix}/{world.name}", text)
    try:
        wait_keys(
            world.store,
            world.waits,
            [f"{prefix}/{n}" for n in names],
            timeout,
            f"create_rpc_group({group_name!r})",
        )
    except TimeoutError as exc:
        missing = [n for n in names if not world.store.check([f"{prefix}/{n}"])]
        raise TimeoutError(
            f"create_rpc_group({group_name!r}) timed out after {timeout:g} s; members that did not join: "
            f"{missing}"
        ) from exc
    seen = {n: world.store.get(f"{prefix}/{n}").decode() for n in names}
    if any(v != text for v in seen.values()):
        raise ValueError(f"members disagree on RpcGroup {group_name!r}: {seen} (member: members)")
    return names, instance


def chain_future(
    raw: torch.futures.Future[Any], target: str, finish: Callable[[Any], Any]
) -> torch.futures.Future[Any]:
    """A future completed with ``finish(envelope)``, or its exception; transport errors are mapped."""
    out: torch.futures.Future[Any] = torch.futures.Future()

    def done(fut: torch.futures.Future[Any]) -> None:
        try:
            envelope = fut.wait()
        except RuntimeError as exc:
            out.set_exception(with_cause(transport_error(exc, target, "rpc_async"), exc))
            return
        try:
            out.set_result(finish(envelope))
        except Exception as exc:
            out.set_exception(exc)

    raw.add_done_callback(done)
    return out


def claim_entry(
    tables: GroupTables, kind: str, ktext: str, obj: Any, store: Any, dir_key: str, me: str, taken: str
) -> None:
    """Put ``obj`` in this process's table and claim ``dir_key`` in the store; undo and raise if taken.

    The table entry comes first, so the directory never names an owner that lacks the object. The table lock
    is not held across the store request (other threads' calls and registrations go on meanwhile); the key is
    marked pending instead, and a call for this very key waits until the claim settled.

    Raises:
        KeyError: ``taken``, if this process or another one holds the key.
    """
    table: dict[str, Any] = tables.values if kind == VALUE else tables.services
    with tables.lock:
        if ktext in table or (kind, ktext) in tables.pending:
            raise KeyError(taken)
        table[ktext] = obj
        tables.pending.add((kind, ktext))
    won = False
    try:
        won = claim(store, dir_key, me) == me
    finally:
        with tables.lock:
            tables.pending.discard((kind, ktext))
            if not won:
                del table[ktext]
            tables.settled.notify_all()
    if not won:
        raise KeyError(taken)


def release_entry(
    tables: GroupTables, kind: str, ktext: str, store: Any, dir_key: str, me: str, not_owner: str
) -> None:
    """Remove this process's entry and its directory key (the table lock is not held across the store).

    Raises:
        KeyError: ``not_owner``, if this process does not hold the key.
    """
    table: dict[str, Any] = tables.values if kind == VALUE else tables.services
    with tables.lock:
        if ktext not in table or (kind, ktext) in tables.pending:
            raise KeyError(not_owner)
        tables.pending.add((kind, ktext))
    released = False
    try:
        release(store, dir_key, me)
        released = True
    finally:
        with tables.lock:
            tables.pending.discard((kind, ktext))
            if released:
                del table[ktext]
            tables.settled.notify_all()
