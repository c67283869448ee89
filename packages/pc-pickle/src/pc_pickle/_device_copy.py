"""Copies between a device storage and host bytes, large CUDA copies staged through pinned host buffers.

A device->host copy into pageable memory runs at a fraction of the bus, so storages of at least
:data:`STAGE_MIN` bytes on a staged device type move in chunks through a bounded pool of pinned buffers: the
chunk planning and pipelining of :mod:`pc_pickle._staging`, with CUDA's asynchronous copies, its events and a
pinned allocator plugged in. Smaller storages, and copies that find no free staging slot within
:data:`LEASE_TIMEOUT_S`, take one plain synchronous copy. :mod:`pc_pickle._tensors` calls these for its copy
mode; the bytes are the same either way.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from pc_pickle._staging import BufferPool, Waitable, copy_in, copy_out

__all__ = [
    "LEASE_TIMEOUT_S",
    "STAGED_DEVICE_TYPES",
    "STAGE_MIN",
    "stage_to_device",
    "stage_to_host",
    "stage_to_writer",
    "stages",
    "staging_pool",
]

STAGE_MIN = 1 << 20
"""Storages from this size on are staged; smaller ones take one plain synchronous copy."""
STAGED_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
"""Device types whose copies are staged (tests add ``"cpu"`` to run the staging path with CPU fakes)."""
LEASE_TIMEOUT_S = 5.0
"""How long a copy waits for a free staging slot before it copies without staging."""

_FRAME = 64 * 1024  # pickle's FRAME_SIZE_TARGET
_pool: BufferPool[torch.Tensor] | None = None
_pool_lock = threading.Lock()


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty((nbytes,), dtype=torch.uint8, pin_memory=True)


def staging_pool() -> BufferPool[torch.Tensor]:
    """The process's pool of pinned staging buffers, made on first use (no CUDA work at import)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = BufferPool(_pinned)
        return _pool


def _record_event() -> Waitable:
    """An event recorded on the current CUDA stream, after the copies just queued there."""
    event_type: Any = torch.cuda.Event  # Any: its constructor is untyped on some torch releases
    event: Waitable = event_type()
    event_type.record(event)
    return event


def stages(device: torch.device, nbytes: int) -> bool:
    """Whether a copy of ``nbytes`` on ``device`` goes through the staging buffers."""
    # A deferred buffer must be at least the C pickler's frame size, so that the pickler writes it to the
    # file as it is instead of copying its (not yet written) bytes into a frame.
    return device.type in STAGED_DEVICE_TYPES and nbytes >= max(STAGE_MIN, _FRAME)


def _on(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@contextlib.contextmanager
def _leased(device: torch.device) -> Iterator[tuple[BufferPool[torch.Tensor], list[torch.Tensor] | None]]:
    """A staging slot, entered on ``device``'s context.

    The buffers are None when the pool stays busy or pinned memory is refused (a locked-memory limit): the
    caller then copies without staging.
    """
    pool = staging_pool()
    with _on(device), contextlib.ExitStack() as stack:
        try:
            buffers = stack.enter_context(pool.lease(LEASE_TIMEOUT_S))
        except RuntimeError:
            buffers = None
        yield pool, buffers


def _stage_out(
    source: torch.Tensor,
    drain: Callable[[int, int, torch.Tensor], None],
    unstaged: Callable[[], object],
) -> None:
    """Copy a 1-D uint8 device tensor out through pinned chunks, double-buffered (see :func:`copy_out`).

    ``drain(at, n, buffer)`` takes each finished chunk from its pinned buffer; ``unstaged()`` copies
    everything at once when no staging slot is to be had.
    """
    with _leased(source.device) as (pool, buffers):
        if buffers is None:
            unstaged()
            return

        def start(at: int, n: int, buffer: torch.Tensor) -> Waitable:
            buffer[:n].copy_(source[at : at + n], non_blocking=True)
            return _record_event()

        copy_out(source.numel(), pool.chunk_bytes, buffers, start, drain)


def stage_to_host(source: torch.Tensor, dest: memoryview) -> None:
    """Copy a 1-D uint8 device tensor into ``dest`` through pinned chunks, double-buffered.

    Args:
        source: The bytes on the device (a uint8 view of a whole storage).
        dest: A writable byte memoryview of the same size (a region of the final payload).
    """
    out = torch.frombuffer(dest, dtype=torch.uint8)

    def drain(at: int, n: int, buffer: torch.Tensor) -> None:
        out[at : at + n].copy_(buffer[:n])  # host to host: torch's copy uses the intra-op threads

    _stage_out(source, drain, lambda: out.copy_(source))


def stage_to_writer(source: torch.Tensor, write: Callable[[memoryview], object]) -> None:
    """Hand a 1-D uint8 device tensor's bytes to a file's ``write``, chunk by chunk from the pinned buffers.

    No full-size host copy is made (except on the unstaged fallback): each chunk's pinned buffer is given to
    ``write`` and reused once ``write`` returned.

    Args:
        source: The bytes on the device (a uint8 view of a whole storage).
        write: The file's ``write``.
    """

    def drain(at: int, n: int, buffer: torch.Tensor) -> None:
        write(_bytes_of(buffer)[:n])

    def unstaged() -> None:
        host = source.cpu()
        write(_bytes_of(host))

    _stage_out(source, drain, unstaged)


def _bytes_of(buffer: torch.Tensor) -> memoryview:
    """A writable byte memoryview over a contiguous uint8 CPU tensor's memory (a pinned staging buffer)."""
    return memoryview((ctypes.c_char * buffer.numel()).from_address(buffer.data_ptr())).cast("B")


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer``, filled by the buffer protocol's public C API ``PyObject_GetBuffer``."""

    _fields_ = (
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    )


# Prototypes of their own, so that ctypes.pythonapi's shared function objects are left as they are.
_get_buffer = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int)(
    ("PyObject_GetBuffer", ctypes.pythonapi)
)
_release_buffer = ctypes.PYFUNCTYPE(None, ctypes.POINTER(_PyBuffer))(("PyBuffer_Release", ctypes.pythonapi))


def _tensor_over(source: memoryview) -> torch.Tensor:
    """A uint8 tensor over a flat byte view's memory, without a copy, read-only views included.

    ``torch.frombuffer`` warns on a read-only buffer (the payload ``bytes`` of a load), so for one the
    tensor is made over the view's address instead. It is only read from; ``source`` must stay alive (and
    unchanged) while the tensor is used.
    """
    if not source.readonly:
        return torch.frombuffer(source, dtype=torch.uint8)
    view = _PyBuffer()
    _get_buffer(source, ctypes.byref(view), 0)  # PyBUF_SIMPLE: a contiguous view of bytes
    try:
        address = view.buf
    finally:
        _release_buffer(ctypes.byref(view))  # source itself still holds its export
    return torch.frombuffer((ctypes.c_char * len(source)).from_address(address), dtype=torch.uint8)


def stage_to_device(source: memoryview, device: torch.device) -> torch.UntypedStorage:
    """Copy host bytes to a new storage on ``device`` through pinned chunks, asynchronously.

    The bytes are read where they are (a region of the payload being loaded, read-only when the payload is
    ``bytes``): each chunk is copied once, by torch's (multi-threaded) copy, from ``source`` into a pinned
    buffer, and sent from there to the device, so no full-size host copy is made.

    Args:
        source: The bytes, a flat byte-format memoryview; it must stay unchanged until this returns.
        device: Where the storage goes.

    Returns:
        The new storage; every copy into it has finished.
    """
    host = _tensor_over(source)
    out = torch.empty((host.numel(),), dtype=torch.uint8, device=device)
    with _leased(device) as (pool, buffers):
        if buffers is None:
            out.copy_(host)
            return out.untyped_storage()

        def start(at: int, n: int, buffer: torch.Tensor) -> Waitable:
            buffer[:n].copy_(host[at : at + n])
            out[at : at + n].copy_(buffer[:n], non_blocking=True)
            return _record_event()

        copy_in(host.numel(), pool.chunk_bytes, buffers, start)
    return out.untyped_storage()
