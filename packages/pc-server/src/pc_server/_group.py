"""The slice of pc-distributed's ``RpcGroup`` that the servers use, and the one place that calls it.

Typing against a protocol keeps the servers testable with an in-process fake group, and :func:`call_service`
is the single choke point that turns transport failures into errors naming the server that did not answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

__all__ = ["GroupLike", "call_service", "check_group", "check_name"]


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
        self,
        key: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        *,
        owner: str | None = None,
    ) -> Any:
        """Call the service registered under ``key`` and return its result.

        In the owner's own process the service runs without an RPC, on copies of the arguments and the
        result; with ``owner`` given the call goes to that member without a directory look-up.
        """

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


def call_service(
    group: GroupLike, key: str, args: tuple[Any, ...], server: str, owner: str | None = None
) -> Any:
    """Call a registered service in one RPC (none in its owner's process); transport failures name the server.

    Remote exceptions raised by the service itself keep their type (pc-distributed re-raises them); a dead or
    hung owner surfaces as ``ConnectionError`` or ``TimeoutError`` whose message names ``server`` and the
    service, chained to the transport error.

    Args:
        group: The RpcGroup.
        key: The service key.
        args: Positional arguments.
        server: The server's name, for error messages.
        owner: The member that registered ``key``, when known: the call then skips the directory.

    Returns:
        The service's result.

    Raises:
        KeyError: No member (not ``owner``, when given) holds the service.
        ConnectionError: The owner is unreachable (e.g. it died).
        TimeoutError: The owner did not answer within the RPC timeout.
    """
    try:
        return group.registered_sync(key, args=args, owner=owner)
    except ConnectionError as exc:
        raise ConnectionError(
            f"pc-server: server {server!r} is unreachable (service {key!r}): {exc}"
        ) from exc
    except TimeoutError as exc:
        raise TimeoutError(
            f"pc-server: server {server!r} did not answer in time (service {key!r}): {exc}"
        ) from exc
