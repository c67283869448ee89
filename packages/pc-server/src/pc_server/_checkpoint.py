"""What every pc-server ``state_dict()`` shares: a format tag, and validation that names what is wrong.

A state dict is a plain dict of picklable values (tensors, ints, strs, dicts, lists), so ``torch.save`` and
``torch.load(..., weights_only=False)`` store it; each carries ``"format"`` (which server wrote it) and
``"format_version"``, so a checkpoint of another server or of a newer layout is refused with a clear error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["FORMAT_VERSION", "check_int", "check_state", "header"]

FORMAT_VERSION = 1


def header(fmt: str) -> dict[str, Any]:
    """The first entries of a state dict written by the server kind ``fmt``."""
    return {"format": fmt, "format_version": FORMAT_VERSION}


def check_state(state: object, fmt: str, keys: tuple[str, ...]) -> Mapping[str, Any]:
    """Validate the envelope of a state dict: a mapping with ``fmt``'s tag, our layout and ``keys``.

    Args:
        state: The value given to ``load_state_dict``.
        fmt: The format tag the loading server writes.
        keys: Entries that must be present.

    Returns:
        ``state``.

    Raises:
        TypeError: ``state`` is not a mapping.
        ValueError: Another server's checkpoint, another layout version, or a missing entry (named).
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"state_dict must be a dict from {fmt}.state_dict(), got {type(state).__name__}")
    found = state.get("format")
    if found != fmt:
        raise ValueError(f"state_dict was written by {found!r}, not {fmt!r}; load it into its own kind")
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{fmt} state_dict has format_version {state.get('format_version')!r}; this pc-server reads "
            f"{FORMAT_VERSION}"
        )
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"{fmt} state_dict lacks {missing}")
    return state


def check_int(what: str, value: object, minimum: int = 0) -> int:
    """Validate a non-negative (or ``>= minimum``) int entry of a state dict; the message names ``what``.

    Raises:
        ValueError: ``value`` is not an int, or is smaller than ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"state_dict entry {what} must be an int >= {minimum}, got {value!r}")
    return value
