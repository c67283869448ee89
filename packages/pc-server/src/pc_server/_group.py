"""The slice of pc-distributed's ``RpcGroup`` that the servers use, and the one place that calls it.

Typing against a protocol keeps the servers testable with an in-process fake group, and :func:`call_service`
is the single choke point that turns transport failures into errors naming the server that did not answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from pc_server._local import register_local

__all__ = ["GroupLike", "call_member", "call_service", "check_group", "check_name", "register_service"]


@runtime_checkable
class GroupLike(Protocol):
    """What pc-server needs from a ``pc_distributed.RpcGroup`` (the part of the RpcGroup API it uses)."""

    def register(self, key: str, service: Callable[..., Any]) -> Any:
        """Register ``service`` under ``key``; it runs on this process's live object."""

    def pair(self, key: str, value: Any) -> Any:
        """Pair ``value`` under ``key`` in the group."""

    def get_paired(self, key: str) -> Any:
        """Return an RRef-like object (``to_here()``) to the value paired under ``key``."""

    def registered_sync(
        self, key: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Call the service registered under ``key`` and return its result."""

    def rpc_sync(
        self,
        to: str,
        func: Callable[..., Any],
        timeout: float = -1,
        args: Any = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Run the module-level ``func(*args)`` on member ``to``; return its result (no directory look-up)."""

    def get_group_name(self) -> str:
        """The group's name."""

    def get_group_members(self) -> list[str]:
        """The sorted member names."""

    def get_cur_name(self) -> str:
        """This process's name."""

    def is_member(self, target: str | None = None) -> bool:
        """Whether ``target`` (default: this process) is a member."""


def check_group(group: object) -> GroupLike:
    """Validate that ``group`` looks like an ``RpcGroup``.

    Args:
        group: The value to check.

    Returns:
        The group.

    Raises:
        TypeError: If it lacks the RpcGroup methods.
    """
    if not isinstance(group, GroupLike):
        raise TypeError(f"group must be a pc_distributed.RpcGroup, got {type(group).__name__}")
    return group


def check_name(what: str, value: object) -> str:
    """Validate a server or model name: a non-empty str.

    Args:
        what: The argument's name, for the message.
        value: The value to check.

    Returns:
        The name.

    Raises:
        TypeError: If it is not a str.
        ValueError: If it is empty.
    """
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a non-empty str, got {value!r} ({type(value).__name__})")
    if not value:
        raise ValueError(f"{what} must be a non-empty str, got ''")
    return value


def register_service(group: GroupLike, key: str, service: Callable[..., Any]) -> None:
    """Register ``service`` under ``key`` in ``group``, and for this process's accessors (``_local``).

    An accessor in this process finds it with ``find_local(group, key)`` and calls it without an RPC to
    itself; so the service must accept its own process's arguments as they are (no copy is made).

    Raises:
        KeyError: ``key`` is already registered in the group.
    """
    group.register(key, service)
    register_local(group, key, service)


def call_service(group: GroupLike, key: str, args: tuple[Any, ...], server: str) -> Any:
    """Call a registered service in one RPC; transport failures name the server.

    Remote exceptions raised by the service itself keep their type (pc-distributed re-raises them); a dead or
    hung owner surfaces as ``ConnectionError`` or ``TimeoutError`` whose message names ``server`` and the
    service, chained to the transport error.

    Args:
        group: The RpcGroup.
        key: The service key.
        args: Positional arguments.
        server: The server's name, for error messages.

    Returns:
        The service's result.

    Raises:
        ConnectionError: The owner is unreachable (e.g. it died).
        TimeoutError: The owner did not answer within the RPC timeout.
    """
    try:
        return group.registered_sync(key, args=args)
    except ConnectionError as exc:
        raise ConnectionError(
            f"pc-server: server {server!r} is unreachable (service {key!r}): {exc}"
        ) from exc
    except TimeoutError as exc:
        raise TimeoutError(
            f"pc-server: server {server!r} did not answer in time (service {key!r}): {exc}"
        ) from exc


def call_member(
    group: GroupLike, member: str, func: Callable[..., Any], args: tuple[Any, ...], server: str
) -> Any:
    """Run ``func(*args)`` on ``member`` in one RPC, addressed by name (no service directory look-up).

    Args:
        group: The RpcGroup.
        member: The member to run on.
        func: A module-level function.
        args: Positional arguments.
        server: The server's name, for error messages.

    Returns:
        ``func``'s result.

    Raises:
        ConnectionError: ``member`` is unreachable (e.g. it died).
        TimeoutError: ``member`` did not answer within the RPC timeout.
    """
    try:
        return group.rpc_sync(member, func, args=args)
    except ConnectionError as exc:
        raise ConnectionError(f"pc-server: server {server!r} is unreachable on {member!r}: {exc}") from exc
    except TimeoutError as exc:
        raise TimeoutError(
            f"pc-server: server {server!r} did not answer in time on {member!r}: {exc}"
        ) from exc
