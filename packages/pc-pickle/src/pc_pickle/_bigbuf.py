"""Large buffers backed by transparent huge pages: the copy path's one copy each way, without 4 KiB faults.

A copy into fresh memory costs far more than the copy: every 4 KiB page faults in and is zeroed by the
kernel first; ``madvise(MADV_HUGEPAGE)`` (2 MiB pages: 512x fewer faults) removes most of that cost (the
numbers are in docs/pickle.md, Performance). Transparent huge pages are commonly enabled in ``madvise``
mode, so a buffer only gets them when asked; this module asks for the two big buffers of a copy round trip:

* :func:`join` builds the payload ``bytes`` of :func:`pc_pickle.dumps` (a fresh, not yet touched bytes
  object, advised, then filled piece by piece) instead of ``b"".join``;
* :func:`advise` is called on the fresh ``bytearray`` the unpickler allocates for a CPU tensor's raw bytes,
  before the bytes are copied in (by the loader's reader, or when the lent region is taken back:
  :class:`pc_pickle._tensors.LentRegions`).

Both are no-ops where ``madvise`` is missing (not Linux) or refuses; they change only the page size of memory
that is about to be written, never its contents.

Even in huge pages, faulting a fresh buffer in (the kernel zeroes every page first) costs about as much as
the copy into it when one thread does both. :func:`join` therefore also has the pages of a buffer of at
least :data:`POPULATE_MIN` bytes faulted in by a few threads at once (``MADV_POPULATE_WRITE``, Linux 5.14+;
a kernel without it refuses and the copy faults them as before) while the copy starts at its front.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

from pc_pickle._staging import deferred_of

__all__ = ["HUGE_MIN", "POPULATE_MIN", "advise", "blank_bytes", "join", "populate"]

HUGE_MIN = 4 << 20
"""Buffers from this size on are advised (a 2 MiB page only helps a buffer spanning several)."""
POPULATE_MIN = 32 << 20
"""Buffers from this size on are faulted in by several threads (below it, handing out the work costs more)."""
POPULATE_THREADS = 8
"""The most threads that fault one buffer in (fewer on a machine with fewer CPUs)."""

_PAGE = 2 << 20
_SMALL_PAGE = 4096
_MADV_HUGEPAGE = 14  # Linux
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels answer EINVAL


def _load_madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_new_bytes.restype = ctypes.py_object
_bytes_address = ctypes.pythonapi.PyBytes_AsString
_bytes_address.argtypes = (ctypes.py_object,)
_bytes_address.restype = ctypes.c_void_p


def advise(address: int, length: int) -> None:
    """Ask for huge pages over the whole 2 MiB pages inside ``[address, address + length)``.

    Args:
        address: Start of memory that is about to be written for the first time.
        length: Its length in bytes; below :data:`HUGE_MIN` nothing is done.
    """
    if _madvise is None or length < HUGE_MIN:
        return
    start = (address + _PAGE - 1) // _PAGE * _PAGE
    end = (address + length) // _PAGE * _PAGE
    if end > start:
        _madvise(start, end - start, _MADV_HUGEPAGE)  # a refusal (EINVAL, ENOMEM) leaves normal pages


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


# The faulting threads, made on first use. Module state: one pool per process, its creation under the lock
# (two threads may assemble payloads at once); a forked child gets a fresh pool (its threads did not fork).
_faulters: concurrent.futures.ThreadPoolExecutor | None = None
_faulters_pid = 0
_faulters_lock = threading.Lock()


def _faulting_pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    global _faulters, _faulters_pid
    with _faulters_lock:
        if _faulters is None or _faulters_pid != os.getpid():
            _faulters = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="pc-pickle-fault")
            _faulters_pid = os.getpid()
        return _faulters


def populate(address: int, length: int) -> list[concurrent.futures.Future[int]]:
    """Start faulting in the pages of ``[address, address + length)``, several threads at once.

    Only for memory that is about to be overwritten: the pages are made present (zeroed by the kernel if they
    were not), never changed otherwise. The caller writes into the buffer meanwhile (the threads and the
    writer fault distinct pages, or wait for each other on one) and must keep it alive until every returned
    future is done.

    Args:
        address: Start of a fresh buffer.
        length: Its length in bytes; below :data:`POPULATE_MIN` (or with one CPU) nothing is started.

    Returns:
        One future per thread's share (``madvise``'s result: 0, or -1 where the kernel refused); empty when
        nothing was started.
    """
    threads = min(POPULATE_THREADS, _cpus())
    if _madvise is None or length < POPULATE_MIN or threads < 2:
        return []
    start = (address + _SMALL_PAGE - 1) // _SMALL_PAGE * _SMALL_PAGE
    end = (address + length) // _SMALL_PAGE * _SMALL_PAGE
    # Shares in whole huge pages, the first one last: the writer starts at the front and faults it itself.
    share = -(-(end - start) // threads // _PAGE) * _PAGE
    pieces = [(at, min(share, end - at)) for at in range(start, end, share)]
    pool = _faulting_pool(threads)
    return [pool.submit(_madvise, at, n, _MADV_POPULATE_WRITE) for at, n in reversed(pieces[1:])]


def blank_bytes(size: int) -> bytes:
    """A ``bytes`` object of ``size`` bytes left uninitialised (no pass over its memory).

    For a stand-in whose identity, not contents, matters (:func:`pc_pickle._payload.outer_pieces`); its bytes
    must never be read.

    Args:
        size: Its length.

    Returns:
        The object.
    """
    out: bytes = _new_bytes(None, size)
    return out


def join(pieces: Sequence[Any]) -> bytes:
    """``b"".join(pieces)``, with the result in huge pages when it is large.

    A piece over a :class:`~pc_pickle._staging.Deferred` placeholder is not read: its ``fill`` writes the
    bytes straight into their place in the result (a CUDA storage staged from the device, without a
    full-size host copy first).

    Args:
        pieces: Bytes-like objects (``bytes``, ``memoryview``, ``pickle.PickleBuffer``), C-contiguous.

    Returns:
        One ``bytes`` object holding the pieces in order.
    """
    views = [memoryview(p).cast("B") for p in pieces]
    placeholders = [deferred_of(p) for p in pieces]
    total = sum(v.nbytes for v in views)
    if (total < HUGE_MIN or _madvise is None) and not any(placeholders):
        return b"".join(views)
    out: bytes = _new_bytes(None, total)  # uninitialised and not shared yet: filled below, then returned
    address = _bytes_address(out)
    advise(address, total)
    faulting = populate(address, total)
    dest = memoryview((ctypes.c_char * total).from_address(address)).cast("B")
    try:
        at = 0
        for view, placeholder in zip(views, placeholders, strict=True):
            if placeholder is not None:
                placeholder.fill(dest[at : at + view.nbytes])
            else:
                dest[at : at + view.nbytes] = view
            at += view.nbytes
    finally:
        concurrent.futures.wait(faulting)  # the threads touch ``out``'s memory: done before it can be freed
    return out
