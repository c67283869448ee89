"""Argument checks shared by the package: one function per kind of argument, one message shape.

A wrong type raises ``TypeError``, a value of the right type that is out of range raises ``ValueError``; a
``bool`` is never taken for an int or a number. Every message reads ``"<name> must be <what>, got <value>"``,
with the value's type added for a ``TypeError``. Each check returns the value (as a float for seconds).
"""

from __future__ import annotations

from typing import TypeGuard

__all__ = ["integer", "optional_non_negative_int", "optional_positive_seconds", "positive_int"]


def _wrong_type(name: str, what: str, value: object) -> TypeError:
    return TypeError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")


def _bad_value(name: str, what: str, value: object) -> ValueError:
    return ValueError(f"{name} must be {what}, got {value!r}")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(name: str, value: object) -> int:
    """Check that ``value`` is an int (not a bool) and return it.

    Raises:
        TypeError: If it is not an int.
    """
    if not _is_int(value):
        raise _wrong_type(name, "an int", value)
    return value


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


def optional_non_negative_int(name: str, value: object) -> int | None:
    """Check that ``value`` is None or an int >= 0 and return it.

    Raises:
        TypeError: If it is neither None nor an int.
        ValueError: If it is an int below 0.
    """
    what = "None or an int >= 0"
    if value is None:
        return None
    if not _is_int(value):
        raise _wrong_type(name, what, value)
    if value < 0:
        raise _bad_value(name, what, value)
    return value


def optional_positive_seconds(name: str, value: object) -> float | None:
    """Check that ``value`` is None or a number of seconds > 0 (NaN is not) and return it as a float.

    Raises:
        TypeError: If it is neither None nor an int or a float.
        ValueError: If it is a number that is not > 0.
    """
    what = "None or a positive number of seconds"
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _wrong_type(name, what, value)
    if not value > 0:
        raise _bad_value(name, what, value)
    return float(value)
