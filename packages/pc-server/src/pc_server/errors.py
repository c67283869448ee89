"""Errors raised by pc-server (subclasses of the closest standard exceptions)."""

from __future__ import annotations

__all__ = ["ReducerStoppedError", "ReducerTraceback"]


class ReducerStoppedError(RuntimeError):
    """A gradient reducer no longer accepts work: it was stopped, or its thread failed (see ``watch()``)."""


class ReducerTraceback(Exception):  # noqa: N818 - it is a traceback text, not an error of its own
    """Carries the formatted traceback of a failed reducer thread; set as ``__cause__`` by ``watch()``.

    Args:
        text: The formatted traceback.
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f"\n--- reducer thread traceback ---\n{self.text}"
