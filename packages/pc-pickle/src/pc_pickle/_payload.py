"""The outer payload: ``_load_payload(format_version, table, graph_bytes)``, an ordinary protocol-5 pickle.

The top-level call is this importable module's function, so plain :func:`pickle.loads` reads a payload too. (A
rebuild function defined in ``__main__`` would be pickled by value and lose its globals in a spawned process.)
:mod:`pc_pickle._seal` puts the checksummed header in front of it.
"""

from __future__ import annotations

import bisect
import ctypes
import pickle
from typing import Any

from pc_pickle._bigbuf import HUGE_MIN, advise, blank_bytes
from pc_pickle._errors import PayloadError
from pc_pickle._seal import FORMAT_VERSION
from pc_pickle._tensors import LentRegions, installed_storages, lent_regions, materialize_entry

__all__ = ["FORMAT_VERSION", "Chunks", "Payload", "outer_pieces", "release_outer", "unpickle"]

# The C pickler writes a bytes object this large straight to its file, not into a frame (FRAME_SIZE_TARGET).
_DIRECT = 64 * 1024


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


class Chunks:
    """A write-only "file" that keeps the pieces the C pickler writes, joined once at the end.

    The C pickler hands buffers of 64 KiB and more straight to ``write`` (no copy into its own buffer), so a
    large tensor costs one copy in :func:`pc_pickle.dumps` (the join, into huge pages:
    :mod:`pc_pickle._bigbuf`) instead of the two or three of ``pickle.dumps``, whose output buffer grows by
    reallocation.
    """

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[Any] = []

    def write(self, data: Any) -> int:
        self.parts.append(data)  # kept alive (and unchanged: the dump is synchronous) until the join
        return len(memoryview(data))


def outer_pieces(table: list[tuple[Any, ...]], graph: list[Any]) -> list[Any]:
    """The pieces of the outer pickle ``_load_payload(FORMAT_VERSION, table, graph bytes)``.

    The graph's bytes are the concatenation of its pieces, but they are not joined into one object here: the
    outer pickler writes a same-sized stand-in (never read, never filled) straight to the file, and its
    pieces take the stand-in's place. The bytes are then copied once, by the final join, not twice.

    Args:
        table: The materialized storage table.
        graph: The graph's pickle, as pieces.

    Returns:
        The outer pickle's pieces (bytes, and ``PickleBuffer`` objects of raw storage bytes).
    """
    size = sum(memoryview(piece).nbytes for piece in graph)
    if size >= _DIRECT and all(type(piece) is bytes for piece in graph):
        stand_in = blank_bytes(size)
        chunks = Chunks()
        pickle.Pickler(chunks, protocol=5).dump(Payload(table, stand_in))
        for at, piece in enumerate(chunks.parts):
            if piece is stand_in:
                return [*chunks.parts[:at], *graph, *chunks.parts[at + 1 :]]
    # Small graphs are copied into the outer pickler's frame anyway (and a stand-in the pickler copied, which
    # the loop above did not find, is dropped with its pickle).
    chunks = Chunks()
    pickle.Pickler(chunks, protocol=5).dump(Payload(table, b"".join(graph)))
    return chunks.parts


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


class _Reader:
    """A read-only file over a memoryview for the C unpickler that copies nothing: it hands out views.

    The C unpickler asks ``peek`` for a window of the stream, parses it in memory (as :func:`pickle.loads`
    does), then calls ``read(consumed)`` to step over what it parsed and drops the result. ``peek`` returns
    the rest of the stream up to the next *stop*, and ``read`` a view: the bytes are parsed in place. (The
    ``io.BytesIO`` used before copied each 128 KiB window again when it stepped over it, and the nested
    graph's bytes once more on their way out of the payload: 2 extra copies of the graph per load.)

    The stops are where the raw bytes of large tensor storages begin (the seal's regions). A window ends at
    one, so the unpickler reads each region whole with ``readinto``, into the fresh ``bytearray`` it
    allocated for it, rather than copying part of it out of a window into 4 KiB pages that each fault in.
    With ``regions``, a region is not copied there at all: the bytearray is left untouched and the payload's
    bytes are lent (:class:`pc_pickle._tensors.LentRegions`), to be copied once, straight to where the
    storage goes, when its table entry is materialized. Without, they are copied into the bytearray, advised
    to use huge pages first (:mod:`pc_pickle._bigbuf`).

    Args:
        view: The stream, a byte-format memoryview; it must stay unchanged while the unpickler reads it.
        stops: Offsets in ``view`` where raw regions begin, ascending.
        regions: Where to lend the regions instead of copying them.
    """

    __slots__ = ("_at", "_regions", "_stops", "_view")

    def __init__(
        self, view: memoryview, stops: tuple[int, ...] = (), regions: LentRegions | None = None
    ) -> None:
        self._view = view
        self._stops = stops
        self._regions = regions
        self._at = 0

    def peek(self, size: int = 0, /) -> memoryview:
        at = self._at
        stops = self._stops
        index = bisect.bisect_right(stops, at) if stops else 0
        end = stops[index] if index < len(stops) else len(self._view)
        return self._view[at:end]  # may be shorter than size: the unpickler then calls read(size)

    def read(self, size: int = -1, /) -> memoryview:
        at = self._at
        end = len(self._view) if size < 0 else min(at + size, len(self._view))
        self._at = end
        return self._view[at:end]

    def readinto(self, buffer: Any, /) -> int:
        target = memoryview(buffer).cast("B")
        at = self._at
        index = bisect.bisect_left(self._stops, at)
        if self._regions is not None and index < len(self._stops) and self._stops[index] == at and target:
            chunk = self.read(len(target))
            self._regions.lend(target, chunk)
            return len(chunk)
        _advise_target(target)
        chunk = self.read(len(target))
        target[: len(chunk)] = chunk
        return len(chunk)

    def readline(self, size: int = -1, /) -> bytes:
        rest = self._view[self._at :]
        found = bytes(rest[: len(rest) if size < 0 else size]).find(b"\n")
        return bytes(self.read(len(rest) if found < 0 else found + 1))


class _ReleaseUnpickler(_Unpickler):
    """Reads only the outer payload: its storage table is opened and dropped, the graph is never unpickled."""

    def find_class(self, module_name: str, global_name: str, /) -> Any:
        if module_name == __name__ and global_name == "_load_payload":
            return _release_payload
        return super().find_class(module_name, global_name)


def _reader_of(
    data: bytes | bytearray | memoryview, stops: tuple[int, ...], regions: LentRegions | None = None
) -> Any:
    # Any: typeshed's unpickler wants read() -> bytes; the C unpickler takes any buffer (views here).
    view = memoryview(data)
    return _Reader(view if view.format == "B" and view.ndim == 1 else view.cast("B"), stops, regions)


def _load_lending(
    unpickler: type[pickle.Unpickler], data: bytes | bytearray | memoryview, stops: tuple[int, ...]
) -> Any:
    """Run ``unpickler`` over ``data``, its raw regions lent in place to the table entries that hold them."""
    if not stops:
        return unpickler(_reader_of(data, stops)).load()
    with lent_regions() as regions:
        result = unpickler(_reader_of(data, stops, regions)).load()
        if len(regions):  # every region of a verified payload is a storage's bytes, taken when it was built
            raise PayloadError(
                f"corrupt pc_pickle payload: {len(regions)} raw region(s) outside the storage table"
            )
    return result


def release_outer(data: bytes | bytearray | memoryview, stops: tuple[int, ...] = ()) -> None:
    """Open every storage of a verified payload and drop it at once, without unpickling the object graph.

    Args:
        data: The payload.
        stops: Where its raw regions begin (what :func:`pc_pickle._seal.verify` returns).

    Raises:
        PayloadError: For a stream the unpickler rejects.
        SharedHandleError: If a share handle cannot be opened (see :func:`pc_pickle.release`).
    """
    try:
        _load_lending(_ReleaseUnpickler, data, stops)
    except PayloadError:
        raise
    except (EOFError, pickle.UnpicklingError) as exc:
        raise PayloadError(f"truncated or corrupt pc_pickle payload ({len(data)} bytes): {exc}") from exc


def unpickle(data: bytes | bytearray | memoryview, stops: tuple[int, ...] = ()) -> Any:
    """Unpickle one stream with the C unpickler, turning its own errors into :class:`PayloadError`.

    Args:
        data: A pickle stream (read in place: keep it unchanged until this returns).
        stops: Where raw regions begin in ``data``, read with ``readinto`` (see :class:`_Reader`).

    Returns:
        The object.

    Raises:
        PayloadError: For a stream the unpickler rejects (``UnpicklingError``, ``EOFError``) or a name it
            cannot import. Errors raised by the objects' own code (``__setstate__``, reduce callables)
            propagate unchanged.
    """
    try:
        return _load_lending(_Unpickler, data, stops)
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
