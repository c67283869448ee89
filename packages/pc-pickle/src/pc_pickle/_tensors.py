"""Tensor and storage reducers, the per-payload storage table, and the rebuild functions.

A payload is written in two phases (see :mod:`pc_pickle._pickler`):

* Phase 1 pickles the object graph. Each tensor is reduced to ``_rebuild_tensor(index, dtype, shape, stride,
  offset, requires_grad, is_parameter)`` where ``index`` points into a per-payload table with **one entry per
  distinct storage**, so tied weights and views of one storage stay aliased after the load. Phase 1 touches no
  operating-system resource.
* Phase 2 (:meth:`StorageTable.materialize`) turns each storage into a table entry: raw bytes
  (``copy_tensor=True``) or a share handle from :mod:`torch.multiprocessing.reductions`
  (``copy_tensor=False``). It runs only after phase 1 succeeded, so a failed dump leaves no file descriptor,
  shared-memory refcount or CUDA handle behind.

On load, :func:`materialize_entry` turns each entry back into an ``UntypedStorage``; the graph is then
unpickled with that list installed as the thread's current table, which ``_rebuild_tensor`` and
``_rebuild_storage`` read.

Copies of large CUDA storages are staged through a bounded pool of pinned host buffers
(:mod:`pc_pickle._device_copy`): on dump, chunks are copied device->host asynchronously and drained straight
into the final payload (the table entry holds a :class:`~pc_pickle._staging.Deferred` placeholder until the
join); on load, the storage's bytes are read in place from the payload (:class:`LentRegions`), copied chunk
by chunk into pinned buffers and sent to the device asynchronously (a buffer is refilled once its last copy
is done), and the copies are waited for once at the end. The payload bytes are the same as an unstaged copy's.

A CUDA share handle is opened by torch's ``rebuild_cuda_tensor``, which reuses the storage a consumer still
holds for the same handle instead of opening it again (``cudaIpcOpenMemHandle``, most of such a load's cost).
On that reuse torch skips the wait for the producer's event, so pc waits for it itself
(:func:`_open_shared_cuda`); a caller of ``loads(..., opened_cuda=[...])`` is told which storages it may
hold so that a later load of the same storage reuses the handle.

Non-goals: sparse, quantized, nested and meta tensors, tensors with the conjugate or negative bit set, tensor
subclasses other than ``nn.Parameter`` and legacy typed storages in copy mode are left to torch's own
reduction.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import pickle
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.multiprocessing import reductions

from pc_pickle._bigbuf import advise
from pc_pickle._device_copy import stage_to_device, stage_to_host, stage_to_writer, stages
from pc_pickle._errors import PayloadError, SharedHandleError, UnpicklableObjectError
from pc_pickle._staging import Deferred

__all__ = [
    "SHARE_REDUCERS",
    "LentRegions",
    "StorageTable",
    "cuda_reuse_supported",
    "current_storages",
    "installed_storages",
    "lent_regions",
    "materialize_entry",
    "rebuild_cuda_event",
    "reduce_cuda_event",
    "reporting_opened_cuda",
]

# Reduce results are (callable, args) pairs; "Any" because pickle accepts any callable and any argument tuple.
Reduced = tuple[Callable[..., Any], tuple[Any, ...]]


def rebuild_cuda_event(device: Any, handle: bytes) -> torch.cuda.Event:
    """Open the interprocess CUDA event ``handle`` of ``device`` (inverse of :func:`reduce_cuda_event`)."""
    open_handle: Any = torch.cuda.Event.from_ipc_handle  # Any: untyped on some torch releases
    event: torch.cuda.Event = open_handle(device, handle)
    return event


def reduce_cuda_event(event: torch.cuda.Event) -> Reduced:
    """Reduce an interprocess ``torch.cuda.Event`` to its IPC handle, with public ``Event`` methods only.

    torch's own event reducer is not public on every supported release (it became private in 2.15), so pc
    builds the same pair from ``Event.ipc_handle`` and ``Event.from_ipc_handle``, which every release has.
    """
    ipc_handle: Any = event.ipc_handle  # Any: untyped on some torch releases
    return rebuild_cuda_event, (event.device, ipc_handle())


# ----------------------------------------------------------------------------------------------------------
# The share reducers: torch's public reducers, with the mapping `import torch` registers in ForkingPickler for
# torch >= 2, except events (above). They are called from this module only; nothing is registered in
# ForkingPickler or copyreg. A test compares this table with ForkingPickler's so that a torch upgrade that
# changes the mapping fails loudly.
# ----------------------------------------------------------------------------------------------------------
SHARE_REDUCERS: dict[type, Callable[[Any], Reduced]] = {
    torch.Tensor: reductions.reduce_tensor,  # CUDA storages, as a uint8 view of the whole storage
    torch.nn.Parameter: reductions.reduce_tensor,
    torch.UntypedStorage: reductions.reduce_storage,  # CPU storages
    torch.TypedStorage: reductions.reduce_typed_storage,  # legacy typed storages, share mode only
    torch.cuda.Event: reduce_cuda_event,
}

# Table entry tags.
_COPY = 0  # (tag, device string, bytes-like): raw bytes of the whole storage
_SHARE = 1  # (tag, rebuild, args): rebuild(*args) -> UntypedStorage (CPU shared memory)
_SHARE_CUDA = (
    2  # (tag, device string, rebuild, args): rebuild(*args) -> uint8 CUDA tensor over the whole storage
)

_local = threading.local()


def _deferred_host_buffer(storage: torch.UntypedStorage) -> pickle.PickleBuffer:
    """An in-band buffer whose bytes are staged from the device straight into the payload when it is joined.

    Until then it is an untouched placeholder of the storage's size (no physical memory): the C pickler
    hands a buffer this large to the outer file as it is, so the placeholder's bytes are never read.
    """
    source = torch.empty((0,), dtype=torch.uint8, device=storage.device).set_(storage)
    placeholder = Deferred(-1, storage.nbytes())
    placeholder.fill = lambda dest: stage_to_host(source, dest)
    placeholder.stream = lambda write: stage_to_writer(source, write)
    return pickle.PickleBuffer(placeholder)


def _is_plain_tensor(t: torch.Tensor) -> bool:
    """Whether the raw-storage path can rebuild ``t`` exactly (else torch's own reduction is used)."""
    return (
        not t.is_nested
        and t.layout is torch.strided
        and not t.is_quantized
        and t.device.type in ("cpu", "cuda")
        and not t.is_conj()
        and not t.is_neg()
    )


def _host_buffer(storage: torch.UntypedStorage) -> Any:
    """A writable, zero-copy buffer over a CPU storage's bytes, for an in-band ``PickleBuffer``.

    Tensors do not export the buffer protocol; a ctypes array at the storage's address does, without numpy.
    The buffer keeps ``storage`` alive.
    """
    nbytes = storage.nbytes()
    if nbytes == 0:
        return b""
    array = (ctypes.c_char * nbytes).from_address(storage.data_ptr())
    # The buffer -> array -> storage chain keeps the bytes alive as long as the buffer: a device->host copy
    # is a temporary that nothing else holds once the storage table is gone (found on a GPU: dumps of a CUDA
    # tensor returned freed memory after the table stopped outliving the pieces).
    array._pc_storage = storage  # type: ignore[attr-defined]
    # A writable buffer is written as BYTEARRAY8, so it loads as a bytearray that torch.frombuffer wraps
    # without a copy and without the "non-writable buffer" warning.
    return pickle.PickleBuffer(memoryview(array).cast("B"))


class StorageTable:
    """The per-payload table of distinct storages and the tensor policy (copy or share) of one dump.

    Both the C graph pickler and the dill pickler of one dump share one table, so a tensor inside a closure
    and the same tensor elsewhere in the graph refer to the same storage entry.

    Args:
        copy_tensor: True to copy storages as raw bytes, False to send share handles.
    """

    def __init__(self, copy_tensor: bool) -> None:
        self.copy_tensor = copy_tensor
        self.storages: list[torch.UntypedStorage] = []
        self._index: dict[tuple[str, int | None, int, int], int] = {}
        # Keeps temporaries (device->host copies) alive until the outer pickler has written their bytes.
        self._keep: list[object] = []

    # -- phase 1 ---------------------------------------------------------------------------------------------
    def _storage_index(self, storage: torch.UntypedStorage) -> int:
        device = storage.device
        # The storages list holds a reference, so data_ptr cannot be reused by another storage during the
        # dump.
        key = (device.type, device.index, storage.data_ptr(), storage.nbytes())
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = len(self.storages)
            self.storages.append(storage)
        return index

    def reduce_tensor(self, t: torch.Tensor) -> Reduced | Any:
        """Reduce a Tensor or Parameter to a reference into the table (or leave it to torch's reduction).

        Args:
            t: The tensor (exact type ``Tensor`` or ``nn.Parameter``).

        Returns:
            A reduce tuple, or ``NotImplemented`` for tensors the raw-storage path does not cover.

        Raises:
            UnpicklableObjectError: In share mode, for a non-leaf tensor that requires grad.
        """
        if not _is_plain_tensor(t):
            return NotImplemented
        if not self.copy_tensor and t.requires_grad and not t.is_leaf:
            raise UnpicklableObjectError(
                "a non-leaf tensor that requires grad cannot be shared (torch refuses to share autograd "
                "history); "
                "send t.detach() instead, or use copy_tensor=True"
            )
        index = self._storage_index(t.untyped_storage())
        return (
            _rebuild_tensor,
            (
                index,
                t.dtype,
                tuple(t.shape),
                t.stride(),
                t.storage_offset(),
                t.requires_grad,
                type(t) is torch.nn.Parameter,
            ),
        )

    def reduce_untyped_storage(self, storage: torch.UntypedStorage) -> Reduced | Any:
        """Reduce an ``UntypedStorage`` to a reference into the table.

        Args:
            storage: The storage.

        Returns:
            A reduce tuple, or ``NotImplemented`` for devices other than CPU and CUDA.
        """
        if storage.device.type not in ("cpu", "cuda"):
            return NotImplemented
        return (_rebuild_storage, (self._storage_index(storage),))

    def reduce_typed_storage(self, storage: torch.TypedStorage) -> Reduced | Any:
        """Reduce a legacy ``TypedStorage``: torch's share reducer in share mode, torch's own copy otherwise.

        Args:
            storage: The typed storage.

        Returns:
            A reduce tuple, or ``NotImplemented`` (copy mode: ``TypedStorage.__reduce__`` copies it).
        """
        if self.copy_tensor:
            return NotImplemented
        if type(storage) is torch.TypedStorage:
            return reductions.reduce_typed_storage(storage)  # type: ignore[no-untyped-call]
        return reductions.reduce_typed_storage_child(storage)  # type: ignore[no-untyped-call]

    def reduce_event(self, event: torch.cuda.Event) -> Reduced:
        """Reduce a ``torch.cuda.Event`` to an IPC handle (events are always shared, in both modes).

        Args:
            event: An event created with ``interprocess=True``.

        Returns:
            A reduce tuple.
        """
        return reduce_cuda_event(event)

    # -- phase 2 ---------------------------------------------------------------------------------------------
    def materialize(self) -> list[tuple[Any, ...]]:
        """Turn every storage into a table entry: raw bytes or a share handle.

        Returns:
            One entry per storage, in index order.

        Raises:
            UnpicklableObjectError: If torch cannot share a storage (for example a CUDA tensor received from
                another process, which must be cloned before it is sent on).
        """
        entries: list[tuple[Any, ...]] = []
        for index, storage in enumerate(self.storages):
            try:
                entries.append(self._entry(storage))
            except (RuntimeError, OSError) as exc:
                hint = ""
                if storage.device.type == "cuda" and not self.copy_tensor:
                    hint = (
                        " (a CUDA tensor received from another process cannot be re-sent: clone() it first)"
                    )
                raise UnpicklableObjectError(
                    f"tensor storage #{index} ({storage.nbytes()} bytes on {storage.device}) could not be "
                    f"{'copied' if self.copy_tensor else 'shared'}: {exc}{hint}"
                ) from exc
        return entries

    def _entry(self, storage: torch.UntypedStorage) -> tuple[Any, ...]:
        device = storage.device
        if self.copy_tensor:
            if stages(device, storage.nbytes()):
                return (_COPY, str(device), _deferred_host_buffer(storage))
            host = storage if device.type == "cpu" else storage.cpu()  # type: ignore[no-untyped-call]
            self._keep.append(host)
            return (_COPY, str(device), _host_buffer(host))
        if device.type == "cuda":
            # torch shares CUDA memory per tensor; a uint8 view over the whole storage shares the storage, so
            # every tensor of the payload can be rebuilt on it (views stay aliased on the consumer too).
            whole = torch.empty((0,), dtype=torch.uint8, device=device).set_(storage)
            rebuild, args = SHARE_REDUCERS[torch.Tensor](whole)
            return (_SHARE_CUDA, str(device), rebuild, args)
        # CPU: moves an unshared storage into shared memory (one copy; tensors on it see is_shared() == True).
        # file_descriptor strategy: the fd is dup'd into multiprocessing's resource_sharer, and the consumer
        # fetches it from this process, so this process must be alive at load time; the dup is released by the
        # load.
        rebuild, args = SHARE_REDUCERS[torch.UntypedStorage](storage)
        return (_SHARE, rebuild, args)


# ----------------------------------------------------------------------------------------------------------
# Load side
# ----------------------------------------------------------------------------------------------------------
def _check_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = 0 if dev.index is None else dev.index
        if index >= count:
            raise PayloadError(
                f"the payload holds a tensor on {device}, but this process sees {count} CUDA device(s); "
                "load it where that device exists, or dump with the tensor moved to the CPU"
            )
    elif dev.type != "cpu":
        raise PayloadError(f"the payload holds a tensor on unsupported device {device!r}")
    return dev


def _address(buffer: Any) -> int:
    """Where a writable buffer's bytes start."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


class LentRegions:
    """Raw storage regions of the payload being loaded, left in place until their table entry is built.

    The C unpickler reads a region (``BYTEARRAY8``) by allocating a ``bytearray`` of its size and asking the
    reader to ``readinto`` it. The loader's reader instead leaves the bytearray untouched (its pages are
    never faulted in) and lends the payload's own bytes, keyed by the bytearray's address; when the table
    entry holding that bytearray is materialized, :meth:`take` hands the payload view back. A staged storage
    is then copied from the payload view straight into pinned chunks (no full-size host copy); a CPU storage
    is copied into the bytearray, the one copy it always took. One instance per load, used by one thread.
    """

    __slots__ = ("_lent",)

    def __init__(self) -> None:
        self._lent: dict[int, memoryview] = {}

    def __len__(self) -> int:
        return len(self._lent)

    def lend(self, target: memoryview, source: memoryview) -> None:
        """Record that ``target`` (the unpickler's fresh buffer, left unfilled) holds the bytes ``source``."""
        self._lent[_address(target)] = source

    def take(self, data: object) -> memoryview | None:
        """The payload bytes lent for ``data`` (removed from the record), or None when it was filled as usual.

        Raises:
            PayloadError: If the lent bytes do not match ``data``'s size (never for a verified payload).
        """
        if not self._lent or not isinstance(data, bytearray) or not data:
            return None
        source = self._lent.pop(_address(data), None)
        if source is not None and len(source) != len(data):
            raise PayloadError(
                f"corrupt pc_pickle payload: a raw region of {len(source)} bytes was read for a storage of "
                f"{len(data)} bytes"
            )
        return source


@contextlib.contextmanager
def lent_regions() -> Iterator[LentRegions]:
    """Install a fresh :class:`LentRegions` as this thread's while a payload is unpickled (nests)."""
    previous = getattr(_local, "regions", None)
    regions = _local.regions = LentRegions()
    try:
        yield regions
    finally:
        _local.regions = previous


def _fill_region(data: bytearray, source: memoryview) -> None:
    """Copy a lent region into the fresh bytearray it belongs to, in huge pages when large (see _bigbuf)."""
    target = memoryview(data)
    advise(_address(data), len(target))
    target[:] = source


# ----------------------------------------------------------------------------------------------------------
# Reusing an opened CUDA share handle
# ----------------------------------------------------------------------------------------------------------
# torch's rebuild_cuda_tensor first looks the handle up in reductions.shared_cache (weak references keyed by
# (handle, offset)): while this process still holds the storage it opened for that handle, it returns that
# storage and gives back the producer's new reference count at once, instead of opening the handle again. On
# that path it does not wait for the event the producer recorded when it shared the tensor, so a write the
# producer queued before sending could still be running when this process reads. _open_shared_cuda waits for
# it on the device's current stream, as opening the handle does. The argument layout and the cache are torch
# internals (the same from torch 1.1 to 2.13): they are checked once, and where they differ nothing is waited
# for and no storage is reported for keeping, so every load opens its handle as before.
_CUDA_REBUILD_PARAMS = (
    "tensor_cls",
    "tensor_size",
    "tensor_stride",
    "tensor_offset",
    "storage_cls",
    "dtype",
    "storage_device",
    "storage_handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "requires_grad",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)


@functools.cache
def cuda_reuse_supported() -> bool:
    """Whether this torch's CUDA share handles can be reused safely (see the comment above).

    True when :mod:`torch.multiprocessing.reductions` has ``rebuild_cuda_tensor`` with the argument layout pc
    reads and the ``storage_from_cache`` lookup of its handle cache.
    """
    rebuild = getattr(reductions, "rebuild_cuda_tensor", None)
    if not callable(rebuild) or not callable(getattr(reductions, "storage_from_cache", None)):
        return False
    try:
        params = tuple(inspect.signature(rebuild).parameters)
    except (TypeError, ValueError):
        return False
    return params == _CUDA_REBUILD_PARAMS


def _reuses_handles(rebuild: Any) -> bool:
    return cuda_reuse_supported() and rebuild is reductions.rebuild_cuda_tensor


def _open_shared_cuda(rebuild: Any, args: tuple[Any, ...]) -> torch.Tensor:
    """``rebuild(*args)``; where torch will reuse a storage held here, first wait for the producer."""
    if not _reuses_handles(rebuild) or len(args) != len(_CUDA_REBUILD_PARAMS):
        return rebuild(*args)  # type: ignore[no-any-return]
    named = dict(zip(_CUDA_REBUILD_PARAMS, args, strict=True))
    handle = named["storage_handle"]
    if handle is None or named["storage_size_bytes"] == 0:
        return rebuild(*args)  # type: ignore[no-any-return]
    lookup: Any = reductions.storage_from_cache  # Any: untyped
    # Held until rebuild returns, so the storage cannot die in between and rebuild reuses it too.
    held = lookup(named["storage_cls"], (handle, named["storage_offset_bytes"]))
    if held is not None and named["event_sync_required"]:
        index = named["storage_device"]  # the device index, as _share_cuda_ reports it
        device = torch.device("cuda", index) if isinstance(index, int) else torch.device(index)
        event = rebuild_cuda_event(device, named["event_handle"])
        event.wait(torch.cuda.current_stream(device))
    try:
        return rebuild(*args)  # type: ignore[no-any-return]
    finally:
        del held


@contextlib.contextmanager
def _bound(name: str, value: Any) -> Iterator[None]:
    """Set this thread's ``_local.<name>`` to ``value`` for the block, then restore the one before it."""
    previous = getattr(_local, name, None)
    setattr(_local, name, value)
    try:
        yield
    finally:
        setattr(_local, name, previous)


def reporting_opened_cuda(into: list[torch.UntypedStorage] | None) -> contextlib.AbstractContextManager[None]:
    """Context manager: CUDA storages opened from share handles while it is active are appended to ``into``.

    Only where :func:`cuda_reuse_supported`; otherwise nothing is appended (holding a storage would then buy
    nothing, and could not be made safe). ``None`` reports nothing, so a nested load does not report into the
    list of the load around it.

    Args:
        into: The list to append to, or ``None``.
    """
    return _bound("opened_cuda", into)


def materialize_entry(entry: tuple[Any, ...]) -> torch.UntypedStorage:
    """Turn one table entry back into a storage.

    Args:
        entry: A table entry written by :meth:`StorageTable.materialize`.

    Returns:
        The storage: a fresh one (copy) or one aliasing the producer's memory (share).

    Raises:
        PayloadError: For a malformed entry or a missing device.
        SharedHandleError: If a share handle cannot be opened (producer gone, payload loaded twice).
    """
    tag = entry[0]
    if tag == _COPY:
        _, device, data = entry
        dev = _check_device(device)
        if len(data) == 0:
            return torch.UntypedStorage(0, device=dev)  # type: ignore[no-untyped-call]
        regions: LentRegions | None = getattr(_local, "regions", None)
        source = None if regions is None else regions.take(data)
        if source is not None:
            if stages(dev, len(source)):
                return stage_to_device(source, dev)  # from the payload in place; data stays untouched
            _fill_region(data, source)
        if not isinstance(data, bytearray):  # read-only buffers would make frombuffer warn
            data = bytearray(data)
        if stages(dev, len(data)):
            return stage_to_device(memoryview(data), dev)
        host = torch.frombuffer(data, dtype=torch.uint8)
        return (host if dev.type == "cpu" else host.to(dev)).untyped_storage()
    if tag in (_SHARE, _SHARE_CUDA):
        if tag == _SHARE_CUDA:
            _, device, rebuild, args = entry
            _check_device(device)
        else:
            _, rebuild, args = entry
        try:
            result = _open_shared_cuda(rebuild, args) if tag == _SHARE_CUDA else rebuild(*args)
        except (OSError, EOFError, RuntimeError, KeyError, ValueError) as exc:
            raise SharedHandleError(
                f"could not open a shared tensor handle ({type(exc).__name__}: {exc}). Share payloads are "
                "one-shot (load each exactly once) and, with the 'file_descriptor' strategy, the producing "
                "process must be alive when the payload is loaded"
            ) from exc
        if tag == _SHARE:
            return result  # type: ignore[return-value]
        storage: torch.UntypedStorage = result.untyped_storage()
        opened: list[torch.UntypedStorage] | None = getattr(_local, "opened_cuda", None)
        if opened is not None and _reuses_handles(rebuild):
            opened.append(storage)
        return storage
    raise PayloadError(
        f"unknown storage table entry tag {tag!r} (expected {_COPY}, {_SHARE} or {_SHARE_CUDA})"
    )


def installed_storages(storages: list[torch.UntypedStorage]) -> contextlib.AbstractContextManager[None]:
    """Context manager that makes ``storages`` the current thread's table while a graph is unpickled.

    Nested loads (an object whose ``__setstate__`` calls :func:`pc_pickle.loads`) save and restore the outer
    table.

    Args:
        storages: The materialized storages of the payload being loaded.
    """
    return _bound("storages", storages)


def current_storages() -> list[torch.UntypedStorage]:
    """The storages of the payload this thread is loading.

    Returns:
        The list installed by :class:`installed_storages`.

    Raises:
        PayloadError: When called outside a payload load (a tensor reference was unpickled on its own).
    """
    storages: list[torch.UntypedStorage] | None = getattr(_local, "storages", None)
    if storages is None:
        raise PayloadError(
            "a pc_pickle tensor reference was unpickled outside its payload; use pc_pickle.loads"
        )
    return storages


def _storage_at(index: int) -> torch.UntypedStorage:
    storages = current_storages()
    if not 0 <= index < len(storages):
        raise PayloadError(
            f"tensor refers to storage #{index}, but the payload has {len(storages)} storage(s)"
        )
    return storages[index]


def _rebuild_tensor(
    index: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    offset: int,
    requires_grad: bool,
    is_parameter: bool,
) -> torch.Tensor:
    storage = _storage_at(index)
    t = torch.empty((0,), dtype=dtype, device=storage.device).set_(storage, offset, shape, stride)
    if is_parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _rebuild_storage(index: int) -> torch.UntypedStorage:
    return _storage_at(index)
