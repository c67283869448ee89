r"""The payload header: a length and a checksum that :func:`pc_pickle.loads` verifies before it unpickles.

Why: the C unpickler trusts the stream. A one-byte change can name another module (``ModuleNotFoundError``),
turn a length into garbage (``UnicodeDecodeError``, ``MemoryError``) or turn data into a ``LONG_BINPUT``
whose memo index makes the unpickler zero-fill gigabytes before it fails (16 bytes per index: a 29-byte
stream asked for 1.2 GB). Checking opcodes one by one in Python would cost about ten times more than
unpickling them, so instead every payload carries its length and a CRC-32, checked at C speed before the
unpickler sees a byte. A truncated, extended or changed payload is refused with a
:class:`~pc_pickle.PayloadError` and nothing beyond the header is read.

Layout (the header is a ``BINBYTES`` that the stream pops, so plain :func:`pickle.loads` still reads the
payload, without the check)::

    \x80\x05  B <u32 n>  HEAD  REGIONS  0  <the outer pickle: _load_payload(version, table, graph)>
    HEAD    = "PCPK", u16 format version, u64 total length, u32 CRC-32, u32 region count
    REGIONS = (u64 offset, u64 length) per region, offsets relative to the outer pickle's first byte

The regions are the raw bytes of tensor storages of 64 KiB and more, which the C pickler writes as separate
pieces: they are data, never parsed, and leaving them out keeps the checksum's cost independent of tensor
sizes (hashing a 100 MB tensor twice would add 0.2x the cost of pickling it). A changed byte inside one
changes a tensor value, nothing else. The CRC covers everything else, the header included (all single-byte
changes and all bursts up to 32 bits are detected with certainty; other changes with probability 1 - 2^-32).

Non-goal: authenticity. A payload crafted to carry a valid checksum is code (loading runs what it names):
trusted input only.
"""

from __future__ import annotations

import pickle
import struct
import zlib
from collections.abc import Iterable
from typing import Any

from pc_pickle._errors import PayloadError

__all__ = ["FORMAT_VERSION", "seal", "verify"]

# Version 2: the checksummed header (version 1 payloads had none).
FORMAT_VERSION = 2
_TAG = b"PCPK"
_PREFIX = b"\x80\x05B"  # PROTO 5, BINBYTES: the header is a bytes object that the stream pops
_LEN = struct.Struct("<I")
_HEAD = struct.Struct("<4sHQII")  # tag, version, total length, crc, region count
_CRC_AT = 4 + 2 + 8  # offset of the crc field inside HEAD
_REGION = struct.Struct("<QQ")
_POP = b"0"
_BODY_AT = len(_PREFIX) + _LEN.size  # where HEAD starts


def seal(parts: Iterable[Any]) -> list[Any]:
    """Prefix the outer pickle's pieces with the checksummed header.

    Args:
        parts: What the C pickler wrote, in order: ``bytes`` pieces and, for storages of 64 KiB and more,
            the ``pickle.PickleBuffer`` of the raw bytes (left out of the checksum).

    Returns:
        The pieces of the whole payload: the header first, then ``parts`` unchanged.
    """
    pieces = list(parts)
    crc = 0
    offset = 0
    regions: list[tuple[int, int]] = []
    for piece in pieces:
        size = memoryview(piece).nbytes
        if isinstance(piece, pickle.PickleBuffer):
            regions.append((offset, size))
        else:
            crc = zlib.crc32(piece, crc)
        offset += size
    head_size = _HEAD.size + _REGION.size * len(regions)
    total = _BODY_AT + head_size + len(_POP) + offset
    table = b"".join(_REGION.pack(start, size) for start, size in regions)
    zeroed = _HEAD.pack(_TAG, FORMAT_VERSION, total, 0, len(regions))
    crc = zlib.crc32(table, zlib.crc32(zeroed[_CRC_AT + 4 :], zlib.crc32(zeroed[:_CRC_AT], crc)))
    head = _HEAD.pack(_TAG, FORMAT_VERSION, total, crc, len(regions))
    return [_PREFIX + _LEN.pack(head_size) + head + table + _POP, *pieces]


def _not_ours(data: memoryview, why: str) -> PayloadError:
    return PayloadError(
        f"not a pc_pickle payload ({len(data)} bytes starting with {bytes(data[:16])!r}): {why}; "
        "expected bytes written by pc_pickle.dumps or pc_pickle.Pickler"
    )


def verify(data: memoryview) -> tuple[int, ...]:
    """Check a payload's header, length and checksum; read nothing else.

    Args:
        data: The whole payload, as a byte-format memoryview.

    Returns:
        Where the raw regions begin, as offsets in ``data``, ascending: the loader's reader ends its
        windows there so that the unpickler reads those bytes straight into their destination.

    Raises:
        PayloadError: For bytes not written by pc_pickle, another format version, a truncated or extended
            payload, or a checksum mismatch (the bytes changed after they were written).
    """
    n = len(data)
    if n < _BODY_AT + _HEAD.size + len(_POP) or data[: len(_PREFIX)] != _PREFIX:
        raise _not_ours(data, "no pc_pickle header")
    (head_size,) = _LEN.unpack_from(data, len(_PREFIX))
    tag, version, total, crc, count = _HEAD.unpack_from(data, _BODY_AT)
    if tag != _TAG:
        raise _not_ours(data, "no pc_pickle header")
    if version != FORMAT_VERSION:
        raise PayloadError(
            f"payload format version {version!r} cannot be read by this pc_pickle, which reads version "
            f"{FORMAT_VERSION}; dump and load with the same pc_pickle version"
        )
    if total != n:
        kind = "truncated" if n < total else "extended"
        raise PayloadError(f"{kind} pc_pickle payload: its header says {total} bytes, got {n}")
    body = _BODY_AT + head_size + len(_POP)
    if head_size != _HEAD.size + _REGION.size * count or body > n or data[body - 1 : body] != _POP:
        raise PayloadError(f"corrupt pc_pickle payload header ({n} bytes): inconsistent header size")
    table_at = _BODY_AT + _HEAD.size
    check = 0
    previous = body
    stops = []
    for i in range(count):
        start, size = _REGION.unpack_from(data, table_at + i * _REGION.size)
        start += body
        if start < previous or start + size > n:
            raise PayloadError(f"corrupt pc_pickle payload header ({n} bytes): region {i} out of order")
        check = zlib.crc32(data[previous:start], check)
        stops.append(start)
        previous = start + size
    check = zlib.crc32(data[previous:], check)
    check = zlib.crc32(data[_BODY_AT : _BODY_AT + _CRC_AT], check)
    check = zlib.crc32(data[_BODY_AT + _CRC_AT + 4 : body - 1], check)
    if check != crc:
        raise PayloadError(
            f"corrupt pc_pickle payload ({n} bytes): checksum mismatch (stored {crc:#010x}, computed "
            f"{check:#010x}); the bytes changed after they were written"
        )
    return tuple(stops)
