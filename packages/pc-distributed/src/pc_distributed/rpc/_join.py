"""The join handshake of a new RPC group: every member announces its member list and waits for the others."""

from __future__ import annotations

from collections.abc import Sequence

from pc_distributed._host import GroupHost
from pc_distributed._store import wait_keys

__all__ = ["check_group_args", "join_group"]


def check_group_args(host: GroupHost, group_name: object, members: object) -> list[str]:
    """Validate a group's name and members for this process; return the sorted member names.

    Raises:
        TypeError: On a wrong type.
        ValueError: On invalid members, or if this process is not one of them.
        RuntimeError: If the group already exists in this process.
    """
    if not isinstance(group_name, str) or not group_name:
        raise TypeError(f"group_name must be a non-empty str, got {group_name!r}")
    if isinstance(members, (str, bytes)) or not isinstance(members, Sequence):
        raise TypeError(
            f"members must be a sequence of member names, got {type(members).__name__} {members!r}"
        )
    listed = list(members)
    if not listed or not all(isinstance(n, str) for n in listed) or len(set(listed)) != len(listed):
        raise ValueError(f"members must be non-empty, unique member names, got {listed}")
    names = sorted(listed)
    unknown = [n for n in names if n not in host.get_members()]
    if unknown:
        raise ValueError(f"members {unknown} are not in the world {host.get_members()}")
    if host.name not in names:
        raise ValueError(f"create_rpc_group is called by members only; {host.name!r} is not in {names}")
    if host.get_rpc_group(group_name) is not None:
        raise RuntimeError(f"RpcGroup {group_name!r} already exists in this process; destroy it first")
    return names


def join_group(host: GroupHost, group_name: str, names: list[str], timeout: float) -> int:
    """Wait (through the store) until every member joined ``group_name`` with the same member list.

    Returns:
        This process's instance number of the group name (the how-manieth group of that name it creates).

    Raises:
        ValueError: If the members disagree.
        TimeoutError: Naming the members that did not join within ``timeout`` seconds.
    """
    instance = host.next_rpc_group_instance(group_name)
    store = host.store
    prefix = f"rg/{group_name}/{instance}/join"
    text = ",".join(names)
    store.set(f"{prefix}/{host.name}", text)
    try:
        wait_keys(
            store, host.waits, [f"{prefix}/{n}" for n in names], timeout, f"create_rpc_group({group_name!r})"
        )
    except TimeoutError as exc:
        missing = [n for n in names if not store.check([f"{prefix}/{n}"])]
        raise TimeoutError(
            f"create_rpc_group({group_name!r}) timed out after {timeout:g} s; members that did not join: "
            f"{missing}"
        ) from exc
    seen = {n: store.get(f"{prefix}/{n}").decode() for n in names}
    if any(v != text for v in seen.values()):
        raise ValueError(f"members disagree on RpcGroup {group_name!r}: {seen} (member: members)")
    return instance
