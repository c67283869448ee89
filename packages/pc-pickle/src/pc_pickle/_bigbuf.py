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
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from typing import Any

from pc_pickle._staging import deferred_of

__all__ = ["HUGE_MIN", "advise", "blank_bytes", "join"]

HUGE_MIN = 4 << 20
"""Buffers from this size on are advised (a 2 MiB page only helps a buffer spanning several)."""

_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux


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
    dest = memoryview((ctypes.c_char * total).from_address(address)).cast("B")
    at = 0
    for view, placeholder in zip(views, placeholders, strict=True):
        if placeholder is not None:
            placeholder.fill(dest[at : at + view.nbytes])
        else:
            dest[at : at + view.nbytes] = view
        at += view.nbytes
    return out
