"""Error types of pc-distributed and helpers that carry exceptions between processes.

Every error subclasses the closest standard exception, so existing ``except`` clauses keep working. Remote
exceptions travel as ``(exception, traceback_text)`` envelopes and re-raise in the caller with their original
type and a :class:`RemoteTraceback` as ``__cause__``.
"""

from __future__ import annotations

import contextlib
import pickle
import traceback

__all__ = [
    "RankDiedError",
    "RemoteTraceback",
    "add_note",
    "portable_exception",
    "reraise_remote",
    "with_cause",
]


class RemoteTraceback(Exception):  # noqa: N818 - named like concurrent.futures.process._RemoteTraceback
    """The traceback of an exception raised in another process, attached as ``__cause__``.

    Args:
        text: The formatted remote traceback.
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f"\n'''\n{self.text}'''"


class RankDiedError(RuntimeError):
    """A rank of :func:`~pc_distributed.run_world` exited without returning a result.

    Args:
        rank: The rank that died.
        exitcode: Its exit code (negative: killed by that signal).
        message: The full message.
    """

    def __init__(self, rank: int, exitcode: int | None, message: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode

    def __reduce__(self) -> tuple[type[RankDiedError], tuple[int, int | None, str]]:
        return type(self), (self.rank, self.exitcode, str(self))


def portable_exception(exc: BaseException) -> BaseException:
    """Return ``exc`` if it survives a pickle round trip, else a ``RuntimeError`` naming its type.

    Args:
        exc: The exception raised in this process.

    Returns:
        An exception object that can be sent to another process.
    """
    try:
        clone = pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(
            f"{type(exc).__module__}.{type(exc).__qualname__}: {exc} (exception not picklable)"
        )
    if not isinstance(clone, BaseException):  # pragma: no cover - a broken __reduce__
        return RuntimeError(f"{type(exc).__qualname__}: {exc}")
    return exc


def format_exception(exc: BaseException) -> str:
    """Return the formatted traceback of ``exc`` (as printed by the interpreter)."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def reraise_remote(exc: BaseException, text: str, where: str) -> BaseException:
    """Prepare a remote exception for raising here: ``__cause__`` carries the remote traceback.

    Args:
        exc: The exception object received from the other process.
        text: Its remote traceback text.
        where: Who raised it (e.g. ``"process 1"``), added as a note.

    Returns:
        ``exc``, ready for ``raise``.
    """
    exc.__cause__ = RemoteTraceback(text)
    add_note(exc, f"(raised in {where})")
    return exc


def add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` (PEP 678), also on Python 3.10.

    Python 3.11 and newer have ``BaseException.add_note`` and print the notes under the traceback; on 3.10
    the note is appended to ``exc.__notes__`` directly, where code (and tests) can read it, though 3.10's
    traceback printer does not show it.
    """
    if hasattr(exc, "add_note"):
        exc.add_note(note)
        return
    with contextlib.suppress(AttributeError):  # no __dict__ (a __slots__ type): nowhere to keep it
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]


def with_cause(exc: BaseException, cause: BaseException) -> BaseException:
    """Return ``exc`` with ``__cause__`` set to ``cause`` (for exceptions handed to futures)."""
    exc.__cause__ = cause
    return exc
