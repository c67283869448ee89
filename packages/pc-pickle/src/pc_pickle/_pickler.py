"""The pickler: the C fast path, the two-phase payload, ``dumps`` and ``loads``.

Data flow of one dump::

    obj --phase 1--> _GraphPickler (C pickle, protocol 5) ----------------------------> graph bytes
                       | reducer_override (CPython skips it for None, bool, int, float, str, bytes,
                       |                   list, tuple, dict and set: plain data stays in C)
                       |-- Tensor / Parameter / storage --> StorageTable: one index per distinct storage
                       |-- lambda, local or __main__ function/class --> dill (same table) --> nested bytes
                       |-- lock, cell, code, property, weakref, ... (dill-only types) --> dill
                       |-- file handle, socket, process --> _resources: refused, or (read_files=True)
                       |                   a read-only handle as (path, position), reopened read-only
                       `-- module --> its name
        --phase 2--> StorageTable.materialize(): raw bytes (copy) or share handles (share)
        --> outer C pickle: _load_payload(FORMAT_VERSION, table, graph bytes), the graph's pieces spliced in
        --> _seal.seal: a header with the total length and a CRC-32, checked by loads before unpickling

Phase 2 runs only when phase 1 succeeded, so a failed dump leaves no fd, shared-memory refcount or CUDA
handle. On failure, :mod:`pc_pickle._diagnose` re-walks the graph to name the offending object's access path.
"""

from __future__ import annotations

import functools
import importlib
import pickle
import sys
import types
from collections.abc import Callable
from typing import IO, Any

import torch

from pc_pickle._bigbuf import join
from pc_pickle._diagnose import find_unpicklable
from pc_pickle._errors import UnpicklableObjectError
from pc_pickle._functions import DILL_ONLY_TYPES, needs_by_value, reduce_by_value
from pc_pickle._payload import Chunks, outer_pieces, release_outer, unpickle
from pc_pickle._resources import is_resource, reduce_resource
from pc_pickle._seal import seal, verify
from pc_pickle._staging import write_piece
from pc_pickle._tensors import StorageTable, reporting_opened_cuda

__all__ = ["Pickler", "dumps", "loads"]

_PROTOCOL = 5


class _GraphPickler(pickle.Pickler):
    """Phase 1: the C pickler with a ``reducer_override`` for tensors, by-value functions and modules."""

    def __init__(self, file: IO[bytes], table: StorageTable, recurse: bool, read_files: bool) -> None:
        # type -> reducer (or None: let pickle decide). Per instance, so dynamically created classes are not
        # kept alive; most graphs have few distinct types, so the lookup is one dict probe per object.
        self._reducers: dict[type, Callable[[Any], Any] | None] = {}
        # The C pickler calls reducer_override for every object that is not plain data, so its cost is per
        # object: a plain function in the instance dict (read by the C __init__ below) is called without
        # binding a method, and a type is looked up by subscript (choose runs once per type and pickler).
        self.reducer_override = _make_override(  # type: ignore[method-assign]
            self._reducers, functools.partial(_choose, table=table, recurse=recurse, read_files=read_files)
        )
        super().__init__(file, protocol=_PROTOCOL)


def _choose(cls: type, table: StorageTable, recurse: bool, read_files: bool) -> Callable[[Any], Any] | None:
    """The reducer for objects of exact type ``cls``, or ``None`` to let the C pickler decide."""
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return table.reduce_tensor
    if cls is torch.UntypedStorage:
        return table.reduce_untyped_storage
    if issubclass(cls, torch.TypedStorage):
        return table.reduce_typed_storage
    if issubclass(cls, torch.cuda.Event):
        return table.reduce_event
    # The reducers cached here must not refer to this pickler (no bound methods of self): a pickler ->
    # cache -> bound method -> pickler cycle would keep the pickler's memo, and with it every object and
    # tensor of the graph, alive after dumps returned, until the garbage collector ran.
    if is_resource(cls):
        return functools.partial(reduce_resource, read_files=read_files)
    if cls is types.FunctionType or issubclass(cls, type):
        return functools.partial(_reduce_code, table=table, recurse=recurse, read_files=read_files)
    if cls is types.ModuleType:
        return _reduce_module
    if cls in DILL_ONLY_TYPES:
        return functools.partial(reduce_by_value, table=table, recurse=recurse, read_files=read_files)
    return None


def _make_override(
    reducers: dict[type, Callable[[Any], Any] | None], choose: Callable[[type], Callable[[Any], Any] | None]
) -> Callable[[Any], Any]:
    """``reducer_override`` over a per-pickler cache of reducers by exact type (``None``: plain pickling)."""

    def reducer_override(obj: Any) -> Any:
        # A subscript (no call) with a zero-cost try: the cheapest hit path (docs/pickle.md, Performance)
        try:
            reducer = reducers[type(obj)]
        except KeyError:
            reducer = reducers[type(obj)] = choose(type(obj))
        if reducer is None:
            return NotImplemented
        return reducer(obj)

    return reducer_override


def _reduce_code(obj: Any, table: StorageTable, recurse: bool, read_files: bool) -> Any:
    if needs_by_value(obj):
        return reduce_by_value(obj, table, recurse, read_files)
    return NotImplemented


def _reduce_module(module: types.ModuleType) -> Any:
    # Modules always travel by name: the C pickler cannot pickle them at all, and by-value module state is
    # what mark_static_module exists to avoid on the dill path.
    return (importlib.import_module, (module.__name__,))


def _pickle_graph(obj: Any, table: StorageTable, recurse: bool, read_files: bool) -> list[Any]:
    """Phase 1: the graph's pickle, as the pieces the C pickler wrote (frames of 64 KiB, large objects)."""
    chunks = Chunks()
    _GraphPickler(chunks, table, recurse, read_files).dump(obj)  # type: ignore[arg-type]  # a write-only file
    return chunks.parts


def _explain(
    obj: Any, exc: Exception, recurse: bool, copy_tensor: bool, read_files: bool
) -> UnpicklableObjectError:
    """Build the error for a failed phase 1, with the access path found by a diagnostic re-walk."""
    if isinstance(exc, RecursionError):
        return UnpicklableObjectError(
            f"obj: the object graph is nested too deeply to pickle (deeper than the recursion limit of "
            f"{sys.getrecursionlimit()} frames); flatten it or raise sys.setrecursionlimit"
        )

    def error_of(item: Any) -> BaseException | None:
        try:
            _pickle_graph(item, StorageTable(copy_tensor), recurse, read_files)
        except RecursionError as error:
            return error
        except Exception as error:
            return error
        return None

    try:
        found = find_unpicklable(obj, error_of)
    except RecursionError:
        found = None
    path, culprit, error = found if found is not None else ("obj", obj, exc)
    reason = f"{type(error).__name__}: {error}"
    if isinstance(error, UnpicklableObjectError):  # pc_pickle's own refusal: its message is the reason
        reason = str(error)
        reason = reason.split(": ", 1)[1] if reason.startswith(f"{error.path}: ") else reason
    kind = type(culprit)
    return UnpicklableObjectError(
        f"{path}: cannot pickle {kind.__module__}.{kind.__qualname__} object: {reason}", path=path
    )


def _check_flags(**flags: object) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__qualname__}: {value!r}")


def _build_payload(
    obj: Any, recurse: bool, copy_tensor: bool, read_files: bool
) -> tuple[list[tuple[Any, ...]], list[Any]]:
    _check_flags(recurse=recurse, copy_tensor=copy_tensor, read_files=read_files)
    table = StorageTable(copy_tensor)
    try:
        graph = _pickle_graph(obj, table, recurse, read_files)  # phase 1: no OS resources touched
    except Exception as exc:
        raise _explain(obj, exc, recurse, copy_tensor, read_files) from exc
    return table.materialize(), graph  # phase 2


class Pickler(pickle.Pickler):
    """Write pc_pickle payloads to a binary file.

    Each :meth:`dump` writes one self-contained payload; read it back with :func:`loads` (or
    :func:`pickle.load`). Lambdas, closures, local and ``__main__`` functions and classes are pickled by value
    through dill; everything else takes the C pickler (protocol 5).

    Tensors, ``nn.Parameter``s and storages follow ``copy_tensor``, which defaults to **False (share)** here
    (``dumps`` defaults to copy):

    * ``copy_tensor=True``: each distinct storage is copied once as raw bytes; CUDA tensors are copied to the
      host and back to the same device index on load. The loaded tensors are independent of the sender's.
    * ``copy_tensor=False``: CPU storages travel as shared-memory handles (an unshared storage is moved into
      shared memory at dump: one copy, and ``is_shared()`` becomes True), CUDA storages as CUDA-IPC handles.
      The loaded tensor aliases the sender's memory: writes show on both sides. The reducers are
      :mod:`torch.multiprocessing.reductions`' public ones, set on this instance only.

    Rules for ``copy_tensor=False`` payloads:

    * **One-shot**: load each payload exactly once; dump once per destination. Under 'file_descriptor' a
      second load raises :class:`~pc_pickle.SharedHandleError`; under 'file_system' it is not detected (the
      handle is a name) and hands the payload's one shared-memory reference back twice. A payload that is
      never loaded holds its handle: a dup'd fd until the producer exits ('file_descriptor'), or its
      ``/dev/shm`` segment until torch's shared-memory manager ends ('file_system', after the last process
      that used it exits).
    * **CPU, 'file_descriptor' strategy (the Linux default)**: the producer must be alive when the consumer
      loads, because the fd is fetched from the producer; otherwise :class:`~pc_pickle.SharedHandleError`.
      Each live shared storage holds one fd and each unloaded payload one more, so ``EMFILE`` comes at about
      ``ulimit -n``/2 tensors; above ~1,000 live tensors use the 'file_system' strategy or pack small tensors.
    * **CPU, 'file_system'**: no liveness rule and no fds; a segment leaves ``/dev/shm`` when the last tensor
      on it, in any process, is freed (payloads that were loaded leave nothing behind).
    * **CUDA**: the producer keeps the tensor and its process alive while any consumer uses it; consumers
      ``del`` promptly. A received CUDA tensor cannot be re-sent (``clone()`` it first). Do not fork a
      consumer after CUDA was initialized.

    pc_pickle never changes the sharing strategy: it belongs to the application.

    Args:
        file: A binary file: anything with a ``write(bytes)`` method.
        recurse: For functions pickled by value, carry the globals they reference by value (True) or look them
            up at load time in the function's module in the loading process (False). Functions and classes
            defined in ``__main__`` always carry the ``__main__`` globals they reference by value (the
            loader's ``__main__`` is another script), as cloudpickle does.
        copy_tensor: Copy tensors (True) or share them (False, the default).
        read_files: Carry open read-only file handles, reopened read-only at the same position on load
            (True), or refuse every file handle (False, the default); see :func:`dumps`.

    Raises:
        TypeError: If ``file`` has no ``write`` method, or a flag is not a bool.

    Examples:
        >>> import io, torch
        >>> buf = io.BytesIO()
        >>> Pickler(buf, copy_tensor=True).dump({"w": torch.ones(2), "f": lambda x: x + 1})
        >>> loads(buf.getvalue())["f"](1)
        2
    """

    def __init__(
        self, file: IO[bytes], recurse: bool = False, copy_tensor: bool = False, *, read_files: bool = False
    ) -> None:
        if not callable(getattr(file, "write", None)):
            raise TypeError(
                f"file must be a binary file with a write() method, got {type(file).__qualname__}"
            )
        _check_flags(recurse=recurse, copy_tensor=copy_tensor, read_files=read_files)
        super().__init__(file, protocol=_PROTOCOL)
        self._file = file
        self.recurse = recurse
        self.copy_tensor = copy_tensor
        self.read_files = read_files

    def dump(self, obj: Any, /) -> None:
        """Write one payload holding ``obj``.

        Args:
            obj: The object to pickle.

        Raises:
            UnpicklableObjectError: (a :class:`pickle.PicklingError`) if something in ``obj`` cannot be
                pickled; the message starts with its access path. Nothing is written in that case.
        """
        for piece in _write_payload(obj, self.recurse, self.copy_tensor, self.read_files):
            write_piece(piece, self._file.write)  # a staged CUDA storage is copied here, in chunks


def dumps(obj: Any, recurse: bool = False, copy_tensor: bool = True, *, read_files: bool = False) -> bytes:
    """Pickle ``obj`` to bytes. Works for CPU and CUDA tensors.

    Same as :class:`Pickler` except that ``copy_tensor`` defaults to **True (copy)**. With
    ``copy_tensor=False`` the share rules of :class:`Pickler` apply (one-shot payload; with the
    'file_descriptor' strategy the producer must be alive when the payload is loaded; CUDA producers keep the
    tensor alive).

    What a copy round trip keeps: values, dtype (all of them, bfloat16 and complex included), shape, stride,
    storage offset, device, ``requires_grad`` and ``nn.Parameter``-ness; tensors that share a storage in the
    graph share one storage after the load. What changes: a slice carries its whole storage (``clone()`` it
    first to send less), a non-leaf tensor arrives as a leaf, and ``.grad`` and hooks are not carried.

    Loading never acts outside the loading process. File handles are refused by default (loading one would
    reopen its file, and mode ``"w"`` would empty it); ``read_files=True`` carries open read-only handles
    of named, seekable files as their absolute path and position, and ``loads`` opens them again with
    ``"r"``/``"rb"`` at that position (a file missing by then raises ``FileNotFoundError`` from ``loads``).
    Writable, closed and unnamed handles, sockets, child processes (``subprocess.Popen``) and memory maps
    are refused in both modes. The standard streams load as the loading process's own.

    Args:
        obj: The object to pickle.
        recurse: For functions pickled by value, carry the globals they reference by value (``__main__``
            code always does).
        copy_tensor: Copy tensors (True, the default) or share them (False).
        read_files: Carry open read-only file handles (True) or refuse every file handle (False, the default).

    Returns:
        The payload.

    Raises:
        UnpicklableObjectError: (a :class:`pickle.PicklingError`) if something in ``obj`` cannot be pickled,
            a file handle (or, with ``read_files=True``, a writable one), a socket or a child process among
            them; the message starts with its access path, such as ``obj['fh']``.
        TypeError: If a flag is not a bool.

    Examples:
        >>> import torch
        >>> w = torch.arange(6.0).view(2, 3)
        >>> out = loads(dumps({"w": w, "t": w.t()}))
        >>> out["t"].stride(), out["w"].untyped_storage().data_ptr() == out["t"].untyped_storage().data_ptr()
        ((1, 3), True)
    """
    return join(_write_payload(obj, recurse, copy_tensor, read_files))


def _write_payload(obj: Any, recurse: bool, copy_tensor: bool, read_files: bool) -> list[Any]:
    """The pieces of one sealed payload (the pickler and its storage table are gone when this returns)."""
    return seal(outer_pieces(*_build_payload(obj, recurse, copy_tensor, read_files)))


def loads(
    data: bytes | bytearray | memoryview, *, opened_cuda: list[torch.UntypedStorage] | None = None
) -> Any:
    """Load a payload written by :func:`dumps` or :class:`Pickler`, in this or any other process.

    **Trusted input only**: loading runs code named by the payload. The header check below catches
    accidents (truncation, corruption, foreign bytes), not a payload crafted to pass it.

    Before anything is unpickled, the payload's header is checked: its length and a CRC-32 over everything but
    the raw bytes of large tensor storages. Bytes that were not written by pc_pickle, or were truncated,
    extended or changed since, are refused with :class:`PayloadError` after reading the header only: no
    allocation beyond the input, whatever the bytes declare.

    Errors raised by the objects' own code while they are rebuilt from an intact payload (a ``__setstate__``,
    a ``__reduce__`` callable or ``__init__`` that raises) propagate unchanged, as with :mod:`pickle`: they
    are the object's errors, not the payload's, and callers that catch their own types keep working.

    Opening a shared CUDA tensor's handle (``cudaIpcOpenMemHandle``) is most of what loading it costs. torch
    opens it once per storage while this process still holds a storage it opened for it, so a consumer that
    receives the same CUDA tensor again and again can keep the storages a load opened (``opened_cuda``) until
    its next load: that load then reuses them, waiting for the producer's writes as an opened handle does.
    Holding them keeps the producer's CUDA memory referenced: the producer cannot free it until they are
    dropped.

    Args:
        data: The payload bytes.
        opened_cuda: If given, a list to which the load appends each CUDA storage it opened from a share
            handle at the top level of this payload. Nothing is appended on a torch whose handle reuse pc does
            not recognise (holding them would then buy nothing).

    Returns:
        The object.

    Raises:
        TypeError: If ``data`` is not bytes-like.
        PayloadError: (a :class:`pickle.UnpicklingError`) for foreign, truncated, extended or corrupt bytes
            (checksum mismatch), a payload of another format version, a class or function the payload names
            that cannot be imported here, or a tensor whose device does not exist here. The underlying error,
            if any, is the ``__cause__``.
        SharedHandleError: (a :class:`PayloadError`) if a shared tensor can no longer be opened (producer
            gone, payload loaded twice).
    """
    view, stops = _verified_view(data, "loads")
    with reporting_opened_cuda(opened_cuda):
        return unpickle(view, stops)


def _verified_view(data: object, caller: str) -> tuple[memoryview, tuple[int, ...]]:
    """``data`` as a flat byte view with a valid seal, and where its raw regions begin.

    The one input check of loads and release.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"{caller} expects bytes, bytearray or memoryview, got {type(data).__qualname__}")
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view, verify(view)


def release(data: bytes | bytearray | memoryview) -> None:
    """Free what a share payload holds, for a payload that will never be loaded (the producer's cleanup).

    Until it is loaded, a ``copy_tensor=False`` payload holds, for each CPU storage, one reference on its
    shared-memory segment ('file_system' strategy: the segment stays in ``/dev/shm``, even after every process
    dropped the tensor) or one dup'd fd in the producer ('file_descriptor'). ``release`` takes them back, in
    the producer or in any process that could have loaded the payload, by opening each handle and dropping
    it at once; the object graph is **not** unpickled, so none of the payload's classes or functions run.

    Like a load, a release consumes the payload: release *or* load each share payload, once. A copy payload
    holds nothing, and releasing one only verifies it.

    Args:
        data: The payload bytes.

    Raises:
        TypeError: If ``data`` is not bytes-like.
        PayloadError: For foreign, truncated or corrupt bytes (as :func:`loads`).
        SharedHandleError: If a handle cannot be opened: loaded or released already, or ('file_descriptor')
            the producer is gone, in which case its fds went with it and nothing is left to free.
    """
    with reporting_opened_cuda(None):  # what a release opens is dropped at once, never kept
        release_outer(*_verified_view(data, "release"))
