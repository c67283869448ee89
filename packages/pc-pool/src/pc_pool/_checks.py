"""Argument checks shared by the package: one function per kind of argument, one message shape.

A wrong type raises ``TypeError``, a value of the right type that is out of range raises ``ValueError``; a
``bool`` is never taken for an int. Every message reads ``"<name> must be <what>, got <value>"``, with the
value's type added for a ``TypeError``. Each check returns the value.
"""

from __future__ import annotations

from typing import TypeGuard

__all__ = ["bool_flag", "optional_positive_int", "positive_int"]


def _wrong_type(name: str, what: str, value: object) -> TypeError:
    return TypeError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")


def _bad_value(name: str, what: str, value: object) -> ValueError:
    return ValueError(f"{name} must be {what}, got {value!r}")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(name: str, value: object) -> int:
    """Check that ``value`` is an int >= 1 and return it.

    Raises:
        TypeError: If it is not an int.
        ValueError: If it is below 1.
    """
    if not _is_int(value):
        raise _wrong_type(name, "an int >= 1", value)
    if value < 1:
        raise _bad_value(name, "an int >= 1", value)
    return value


def optional_positive_int(name: str, value: object) -> int | None:
    """Check that ``value`` is None or an int >= 1 and return it.

    Raises:
        TypeError: If it is neither None nor an int.
        ValueError: If it is an int below 1.
    """
    what = "None or an int >= 1"
    if value is None:
        return None
    if not _is_int(value):
        raise _wrong_type(name, what, value)
    if value < 1:
        raise _bad_value(name, what, value)
    return value


def bool_flag(name: str, value: object) -> bool:
    """Check that ``value`` is a bool (not merely truthy) and return it.

    Raises:
        TypeError: If it is not a bool.
    """
    if not isinstance(value, bool):
        raise _wrong_type(name, "a bool", value)
    return value
