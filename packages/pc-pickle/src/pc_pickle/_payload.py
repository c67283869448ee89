"""The outer payload: ``_load_payload(format_version, table, graph_bytes)``, an ordinary protocol-5 pickle.

The top-level call is this importable module's function, so plain :func:`pickle.loads` reads a payload too. (A
rebuild function defined in ``__main__`` would be pickled by value and lose its globals in a spawned process.)
:mod:`pc_pickle._seal` puts the checksummed header in front of it.
"""

from __future__ import annotations

import ctypes
import io
import pickle
from typing import Any

from pc_pickle._bigbuf import HUGE_MIN, advise
from pc_pickle._errors import PayloadError
from pc_pickle._seal import FORMAT_VERSION
from pc_pickle._tensors import installed_storages, materialize_entry

__all__ = ["FORMAT_VERSION", "Payload", "release_outer", "unpickle"]


class Payload:
    """One dump's outer object: the materialized storage table and the pickled graph.

    Args:
        table: The storage table entries (phase 2).
        graph: The pickled object graph (phase 1).
    """

    __slots__ = ("graph", "table")

    def __init__(self, table: list[tuple[Any, ...]], graph: bytes) -> None:
        self.table = table
        self.graph = graph

    def __reduce__(self) -> tuple[Any, ...]:
        return (_load_payload, (FORMAT_VERSION, self.table, self.graph))


class _Unpickler(pickle.Unpickler):
    """The C unpickler; a class or function the payload names that cannot be imported is a PayloadError."""

    def find_class(self, module_name: str, global_name: str, /) -> Any:
        try:
            return super().find_class(module_name, global_name)
        except (ImportError, AttributeError) as exc:
            raise PayloadError(
                f"the payload names {module_name}.{global_name}, which cannot be imported in this process "
                f"({type(exc).__name__}: {exc}); load it where the same code is installed"
            ) from exc


def _advise_target(target: memoryview) -> None:
    """Huge pages for a large fresh buffer the unpickler reads raw tensor bytes into (see _bigbuf)."""
    if len(target) >= HUGE_MIN and not target.readonly:
        advise(ctypes.addressof(ctypes.c_char.from_buffer(target)), len(target))


class _BytesReader(io.BytesIO):
    """``io.BytesIO`` (which shares a bytes object's buffer) with ``peek``, and a ``readinto`` that advises.

    With ``peek`` the C unpickler prefetches a window of the stream and parses it in memory, as
    :func:`pickle.loads` does, instead of calling ``read`` for every opcode. It reads a tensor's raw bytes
    (``BYTEARRAY8``) with ``readinto`` into a bytearray it has just allocated, which is advised first.
    """

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self._view = memoryview(data)

    def peek(self, size: int = 0, /) -> memoryview:
        at = self.tell()
        return self._view[at : at + max(size, 1)]

    def readinto(self, buffer: Any, /) -> int:
        target = memoryview(buffer).cast("B")
        _advise_target(target)
        return super().readinto(target)


class _ViewReader:
    """A read-only file over a memoryview (what the C unpickler uses: read, readinto, readline, peek)."""

    __slots__ = ("_at", "_view")

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._at = 0

    def read(self, size: int = -1) -> bytes:
        end = len(self._view) if size < 0 else min(self._at + size, len(self._view))
        chunk = bytes(self._view[self._at : end])
        self._at = end
        return chunk

    def peek(self, size: int = 0, /) -> memoryview:
        return self._view[self._at : self._at + max(size, 1)]

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        _advise_target(target)
        chunk = self._view[self._at : self._at + len(target)]
        target[: len(chunk)] = chunk
        self._at += len(chunk)
        return len(chunk)

    def readline(self, size: int = -1) -> bytes:
        rest = self._view[self._at :]
        end = bytes(rest[: len(rest) if size < 0 else size]).find(b"\n")
        return self.read(len(rest) if end < 0 else end + 1)


def _file_of(data: bytes | bytearray | memoryview) -> Any:
    # BytesIO shares a bytes object's buffer; other buffers are read in place rather than copied.
    return _BytesReader(data) if type(data) is bytes else _ViewReader(memoryview(data).cast("B"))


class _ReleaseUnpickler(_Unpickler):
    """Reads only the outer payload: its storage table is opened and dropped, the graph is never unpickled."""

    def find_class(self, module_name: str, global_name: str, /) -> Any:
        if module_name == __name__ and global_name == "_load_payload":
            return _release_payload
        return super().find_class(module_name, global_name)


def release_outer(data: bytes | bytearray | memoryview) -> None:
    """Open every storage of a verified payload and drop it at once, without unpickling the object graph.

    Raises:
        PayloadError: For a stream the unpickler rejects.
        SharedHandleError: If a share handle cannot be opened (see :func:`pc_pickle.release`).
    """
    try:
        _ReleaseUnpickler(_file_of(data)).load()
    except PayloadError:
        raise
    except (EOFError, pickle.UnpicklingError) as exc:
        raise PayloadError(f"truncated or corrupt pc_pickle payload ({len(data)} bytes): {exc}") from exc


def unpickle(data: bytes | bytearray | memoryview) -> Any:
    """Unpickle one stream with the C unpickler, turning its own errors into :class:`PayloadError`.

    Args:
        data: A pickle stream.

    Returns:
        The object.

    Raises:
        PayloadError: For a stream the unpickler rejects (``UnpicklingError``, ``EOFError``) or a name it
            cannot import. Errors raised by the objects' own code (``__setstate__``, reduce callables)
            propagate unchanged.
    """
    try:
        return _Unpickler(_file_of(data)).load()
    except PayloadError:
        raise
    except (EOFError, pickle.UnpicklingError) as exc:
        raise PayloadError(f"truncated or corrupt pc_pickle payload ({len(data)} bytes): {exc}") from exc


def _check_outer(version: int, table: list[tuple[Any, ...]], graph: bytes) -> None:
    if version != FORMAT_VERSION:
        raise PayloadError(
            f"payload format version {version!r} cannot be read by this pc_pickle, which reads version "
            f"{FORMAT_VERSION}; dump and load with the same pc_pickle version"
        )
    if not isinstance(table, list) or not isinstance(graph, (bytes, bytearray)):
        raise PayloadError(
            "malformed payload: expected a list and bytes, got "
            f"{type(table).__name__} and {type(graph).__name__}"
        )


def _load_payload(version: int, table: list[tuple[Any, ...]], graph: bytes) -> Any:
    _check_outer(version, table, graph)
    storages = [materialize_entry(entry) for entry in table]
    with installed_storages(storages):
        return unpickle(graph)


def _release_payload(version: int, table: list[tuple[Any, ...]], graph: bytes) -> None:
    _check_outer(version, table, graph)
    for entry in table:
        # Opening a share handle takes back what the dump gave it (a segment reference, a dup'd fd); the
        # storage is dropped at once, so a segment nobody else holds leaves /dev/shm now.
        materialize_entry(entry)
