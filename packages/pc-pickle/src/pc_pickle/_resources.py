"""Objects that stand for something outside the process: file handles, sockets, child processes.

Loading a payload must never act outside the loading process: no file created, truncated or moved, no socket
opened, no process started. dill rebuilds a file handle by opening its file again with the saved mode, so a
handle opened with ``"w"`` empties the file on every load. pc_pickle therefore decides at dump time:

* **File handles** are refused by default, with the access path of the handle in the object graph. With
  ``read_files=True`` an open, read-only handle of a named, seekable file travels as its absolute path and
  position, and loads as a new read-only handle (``"r"`` or ``"rb"``) at that position: opening a file for
  reading never creates or changes it. Writable, closed, unnamed (``os.fdopen``, ``TemporaryFile``) and
  unseekable handles are refused in both modes.
* The interpreter's own standard streams load as the loading process's streams (a reference, no open).
* **Sockets, child processes** (:class:`subprocess.Popen`) **and memory maps** are always refused.

The refusal is an :class:`~pc_pickle.UnpicklableObjectError` raised inside the dump, so it carries the access
path like every other unpicklable object.
"""

from __future__ import annotations

import io
import mmap
import os
import socket
import subprocess
import sys
from typing import IO, Any

from pc_pickle._errors import UnpicklableObjectError

__all__ = ["FILE_TYPES", "is_resource", "reduce_resource"]

FILE_TYPES: frozenset[type] = frozenset(
    {io.TextIOWrapper, io.BufferedReader, io.BufferedWriter, io.BufferedRandom, io.FileIO}
)
_EXTERNAL: tuple[type, ...] = (socket.socket, subprocess.Popen, mmap.mmap)
_STREAMS = ("stdin", "stdout", "stderr")


def is_resource(cls: type) -> bool:
    """Whether instances of ``cls`` are handled here (file handles by exact type, the others by subclass)."""
    return cls in FILE_TYPES or issubclass(cls, _EXTERNAL)


def reduce_resource(obj: Any, read_files: bool) -> tuple[Any, ...]:
    """The reduce tuple of a file handle, socket or process, or the refusal.

    Args:
        obj: An object whose type :func:`is_resource` accepts.
        read_files: Carry open read-only file handles (reopened read-only on load) instead of refusing them.

    Returns:
        A reduce tuple whose load performs no action outside the process.

    Raises:
        UnpicklableObjectError: For every object that could not be loaded without such an action.
    """
    kind = type(obj)
    if isinstance(obj, _EXTERNAL):
        raise UnpicklableObjectError(
            f"{kind.__module__}.{kind.__qualname__} is a resource outside the process (a socket, a child "
            "process or a memory map): pc_pickle refuses it, because loading it would have to open or start "
            "one; send what is needed to recreate it instead"
        )
    for name in _STREAMS:
        if obj is getattr(sys, name, None) or obj is getattr(sys, f"__{name}__", None):
            attr = name if obj is getattr(sys, name, None) else f"__{name}__"
            return (_standard_stream, (attr,))
    return _reduce_file(obj, read_files)


def _reduce_file(handle: IO[Any], read_files: bool) -> tuple[Any, ...]:
    name = getattr(handle, "name", None)
    mode = str(getattr(handle, "mode", "?"))
    what = f"file handle {name!r} (mode {mode!r})"
    if not read_files:
        raise UnpicklableObjectError(
            f"{what}: pc_pickle refuses file handles by default, because loading one reopens its file "
            "(mode 'w' empties it); send the path instead, or pass read_files=True to carry read-only "
            "handles (reopened read-only at the same position)"
        )
    reason = None
    if handle.closed:
        reason = "it is closed"
    elif not isinstance(name, str):
        reason = "it has no file name (opened from a file descriptor or as a temporary file)"
    elif handle.writable() or any(c in mode for c in "wax+"):
        reason = "it is writable, and loading it would create or change the file"
    elif not handle.seekable():
        reason = "it is not seekable (a pipe or a terminal)"
    if reason is not None:
        raise UnpicklableObjectError(f"{what}: read_files=True carries open read-only handles only: {reason}")
    assert isinstance(name, str)
    text = isinstance(handle, io.TextIOWrapper)
    encoding = handle.encoding if isinstance(handle, io.TextIOWrapper) else None
    errors = handle.errors if isinstance(handle, io.TextIOWrapper) else None
    raw = isinstance(handle, io.FileIO)
    return (_reopen_read_only, (os.path.abspath(name), text, raw, encoding, errors, handle.tell()))


def _standard_stream(attr: str) -> Any:
    return getattr(sys, attr)


def _reopen_read_only(
    path: str, text: bool, raw: bool, encoding: str | None, errors: str | None, position: int
) -> IO[Any]:
    """Open ``path`` for reading only (never creates, truncates or moves it) and seek to ``position``."""
    handle: IO[Any]
    if text:
        handle = open(path, encoding=encoding, errors=errors)  # noqa: SIM115 - the loaded object is the handle
    else:
        handle = open(path, "rb", buffering=0 if raw else -1)  # noqa: SIM115
    handle.seek(position)
    return handle
