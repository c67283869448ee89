"""Argument checks of the package: ``TypeError`` for a wrong type, ``ValueError`` for a bad value.

Every message reads ``"<name> must be <what>, got <value>"``, with the value's type added for a
``TypeError``; a ``bool`` is never taken for an int. :func:`pc_sync.comm.check_timeout` checks timeouts.
"""

from __future__ import annotations

__all__ = ["positive_int"]


def positive_int(name: str, value: object) -> int:
    """Check that ``value`` is an int >= 1 (not a bool) and return it.

    Raises:
        TypeError: If it is not an int.
        ValueError: If it is below 1.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 1, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value
