"""Argument checks shared by the package: one function per kind of argument, one message shape.

A wrong type raises ``TypeError``, a value of the right type that is out of range raises ``ValueError``; a
``bool`` is never taken for an int or a number. Every message reads ``"<name> must be <what>, got <value>"``,
with the value's type added for a ``TypeError``. Each check returns the value (as a float for seconds).

Seconds (every timeout of the package) are finite and at most :data:`MAX_TIMEOUT`: no wait of the package is
infinite, and torch cannot take longer ones everywhere (TensorPipe's RPC agent counts a call's timeout in
32-bit milliseconds, about 24.8 days, and turns a longer one into an instant timeout). A longer wait is a
loop of bounded ones in the caller.

**The timeout convention.** Every ``timeout`` argument of pc-distributed means the same: ``None`` is the
owner's default (an RPC call: the World's ``rpc_timeout``; a group barrier: the World's
``rpc_timeout``; ``irecv().wait``: the group's timeout; ``World.stop``: ``rpc_timeout``), any other value is a
number of seconds > 0 and at most ``MAX_TIMEOUT`` (longer, infinite and NaN are a ``ValueError`` at the
call). ``-1`` is accepted everywhere as another name for ``None``, for code written against the original API
(:func:`resolve_timeout`). A call's timeout bounds the caller's whole wait on both RPC backends, whatever the
backend's threads do (calls nested deeper than a member's handler threads included: see
:mod:`pc_distributed.rpc._tensorpipe`).
"""

from __future__ import annotations

from typing import Any, TypeGuard

__all__ = [
    "DEFAULT",
    "MAX_TIMEOUT",
    "bool_flag",
    "check_call_args",
    "int_at_least",
    "int_in_range",
    "integer",
    "non_negative_int",
    "optional_timeout",
    "positive_int",
    "positive_number",
    "positive_seconds",
    "resolve_timeout",
]

# Another name for "the default" (``None``) that every ``timeout`` argument of the package accepts.
DEFAULT = -1

MAX_TIMEOUT = 24 * 24 * 3600.0
"""The longest timeout the package takes, in seconds: 24 days (see the module)."""
_MAX_TEXT = f"{MAX_TIMEOUT:.0f} (24 days)"


def _wrong_type(name: str, what: str, value: object) -> TypeError:
    return TypeError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")


def _bad_value(name: str, what: str, value: object) -> ValueError:
    return ValueError(f"{name} must be {what}, got {value!r}")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integer(name: str, value: object) -> int:
    """Check that ``value`` is an int (not a bool) and return it.

    Raises:
        TypeError: If it is not an int.
    """
    if not _is_int(value):
        raise _wrong_type(name, "an int", value)
    return value


def int_at_least(name: str, value: object, minimum: int) -> int:
    """Check that ``value`` is an int >= ``minimum`` and return it.

    Raises:
        TypeError: If it is not an int.
        ValueError: If it is below ``minimum``.
    """
    what = f"an int >= {minimum}"
    if not _is_int(value):
        raise _wrong_type(name, what, value)
    if value < minimum:
        raise _bad_value(name, what, value)
    return value


def positive_int(name: str, value: object) -> int:
    """Check that ``value`` is an int >= 1 and return it (see :func:`int_at_least`)."""
    return int_at_least(name, value, 1)


def non_negative_int(name: str, value: object) -> int:
    """Check that ``value`` is an int >= 0 and return it (see :func:`int_at_least`)."""
    return int_at_least(name, value, 0)


def int_in_range(name: str, value: object, stop: int) -> int:
    """Check that ``value`` is an int in ``[0, stop)`` (a rank, an index) and return it.

    Raises:
        TypeError: If it is not an int.
        ValueError: If it is outside ``[0, stop)``.
    """
    what = f"an int in [0, {stop})"
    if not _is_int(value):
        raise _wrong_type(name, what, value)
    if not 0 <= value < stop:
        raise _bad_value(name, what, value)
    return value


def positive_number(name: str, value: object) -> float:
    """Check that ``value`` is a number > 0 (NaN is not) and return it as a float.

    Raises:
        TypeError: If it is not an int or a float.
        ValueError: If it is not > 0.
    """
    if not _is_number(value):
        raise _wrong_type(name, "a number > 0", value)
    if not value > 0:
        raise _bad_value(name, "a number > 0", value)
    return float(value)


def _in_seconds_range(value: int | float) -> bool:
    return 0 < value <= MAX_TIMEOUT  # False for NaN and infinities


def positive_seconds(name: str, value: object) -> float:
    """Check that ``value`` is a number of seconds in ``(0, MAX_TIMEOUT]`` and return it as a float.

    Raises:
        TypeError: If it is not an int or a float.
        ValueError: If it is not > 0, or is above :data:`MAX_TIMEOUT` (infinity included), or NaN.
    """
    what = f"a positive number of seconds up to {_MAX_TEXT}"
    if not _is_number(value):
        raise _wrong_type(name, what, value)
    if not _in_seconds_range(value):
        raise _bad_value(name, what, value)
    return float(value)


def optional_timeout(name: str, value: object) -> float | None:
    """Check a ``timeout``-like argument: ``None`` (or :data:`DEFAULT`) for the default, else seconds.

    Returns:
        None for the default, else the seconds as a float.

    Raises:
        TypeError: If it is neither None nor a number.
        ValueError: If it is a number that is neither :data:`DEFAULT` nor in ``(0, MAX_TIMEOUT]`` (infinity
            and NaN are not).
    """
    what = f"None (the default) or a positive number of seconds up to {_MAX_TEXT}"
    if value is None:
        return None
    if not _is_number(value):
        raise _wrong_type(name, what, value)
    if value == DEFAULT:
        return None
    if not _in_seconds_range(value):
        raise _bad_value(name, what, value)
    return float(value)


def bool_flag(name: str, value: object) -> bool:
    """Check that ``value`` is a bool (not merely truthy) and return it.

    Raises:
        TypeError: If it is not a bool.
    """
    if not isinstance(value, bool):
        raise _wrong_type(name, "a bool", value)
    return value


def resolve_timeout(timeout: object, default: float) -> float:
    """Seconds of a wait: ``timeout`` if it is not the default (``None`` or ``-1``), else ``default``."""
    seconds = optional_timeout("timeout", timeout)
    return default if seconds is None else seconds


def check_call_args(args: object, kwargs: object) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Validate ``args``/``kwargs`` of a call and return them as a tuple and a dict.

    Raises:
        TypeError: If ``args`` is not a tuple or list, or ``kwargs`` not a dict or None.
    """
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict or None, got {type(kwargs).__name__}")
    return tuple(args), dict(kwargs or {})
