"""Chunked, double-buffered staging of large copies through a bounded pool of reusable buffers.

Why: a device->host copy into pageable memory runs at a fraction of the bus (the driver stages it through
its own small pinned buffer, synchronously), and a copy into a fresh host buffer that is then joined into the
payload costs a second full-size copy. The copy path (:mod:`pc_pickle._device_copy`) instead moves a large
CUDA storage in chunks through a few pinned buffers: the asynchronous copy of chunk k+1 runs while chunk k is
copied from its pinned buffer straight into the final payload (:func:`copy_out`), and on load chunks are
copied into pinned buffers and sent to the device asynchronously, a buffer refilled once its last copy is
done and the rest waited for at the end (:func:`copy_in`).

This module knows nothing of CUDA: the copies, the events they return and the buffer allocator are
parameters, so the chunk planning, the pipelining and the pool are tested on the CPU with ordinary buffers
and fake events. :class:`Deferred` is the placeholder that lets the final join
(:func:`pc_pickle._bigbuf.join`) write a storage's bytes straight into the payload instead of through a
full-size host copy.
"""

from __future__ import annotations

import collections
import mmap
import pickle
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Generic, Protocol, TypeVar

__all__ = [
    "CHUNK_BYTES",
    "DEPTH",
    "SLOTS",
    "BufferPool",
    "Deferred",
    "Waitable",
    "copy_in",
    "copy_out",
    "deferred_of",
    "spans",
    "write_piece",
]

CHUNK_BYTES = 16 << 20
"""Bytes per staging buffer: large enough that a chunk's fixed costs (an event, a launch) are small."""
DEPTH = 2
"""Buffers per copy: two, so that one chunk is copied while the other is drained (double buffering)."""
SLOTS = 2
"""Copies that can stage at once (each holds ``DEPTH`` buffers): the pool's bound is 64 MB in all."""

B = TypeVar("B")


class Waitable(Protocol):
    """What an asynchronous copy returns: something to wait on (a recorded ``torch.cuda.Event``)."""

    def synchronize(self) -> None:
        """Block until the copy is done."""


def spans(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """Split ``nbytes`` into ``(offset, length)`` chunks of ``chunk`` bytes (the last one shorter).

    Args:
        nbytes: Bytes to copy, >= 0 (0 gives no chunk).
        chunk: Chunk size, >= 1.

    Returns:
        The chunks, in order, covering ``[0, nbytes)`` exactly once.

    Raises:
        ValueError: For a negative size or a chunk size below 1.
    """
    if chunk < 1 or nbytes < 0:
        raise ValueError(f"need nbytes >= 0 and chunk >= 1, got nbytes={nbytes}, chunk={chunk}")
    return [(at, min(chunk, nbytes - at)) for at in range(0, nbytes, chunk)]


def copy_out(
    nbytes: int,
    chunk: int,
    buffers: Sequence[B],
    start: Callable[[int, int, B], Waitable],
    drain: Callable[[int, int, B], None],
) -> None:
    """Copy ``nbytes`` from a source to a destination through ``buffers``, chunk by chunk, pipelined.

    ``start(at, n, buffer)`` begins the asynchronous copy of source bytes ``[at, at + n)`` into ``buffer``
    and returns what to wait on; ``drain(at, n, buffer)`` then copies them from ``buffer`` into the
    destination. With two buffers, the copy of chunk k+1 is in flight while chunk k is drained. A buffer is
    started again only after it was drained. If anything raises, every copy still in flight is waited for
    before the error propagates, so the buffers can be reused at once.

    Args:
        nbytes: Bytes to copy.
        chunk: Chunk size; every buffer holds at least this many bytes.
        buffers: The staging buffers (at least one).
        start: Begins one chunk's copy into a buffer.
        drain: Copies one finished chunk out of its buffer.

    Raises:
        ValueError: Without buffers, or for a bad size (see :func:`spans`).
    """
    if not buffers:
        raise ValueError("copy_out needs at least one buffer")
    depth = len(buffers)
    pending: collections.deque[tuple[int, int, B, Waitable]] = collections.deque()
    try:
        for k, (at, n) in enumerate(spans(nbytes, chunk)):
            if len(pending) == depth:  # the oldest chunk holds the buffer this one needs
                _drain_oldest(pending, drain)
            buffer = buffers[k % depth]
            pending.append((at, n, buffer, start(at, n, buffer)))
        while pending:
            _drain_oldest(pending, drain)
    finally:
        _wait_all(event for *_, event in pending)


def _drain_oldest(
    pending: collections.deque[tuple[int, int, B, Waitable]], drain: Callable[[int, int, B], None]
) -> None:
    at, n, buffer, event = pending[0]
    event.synchronize()
    pending.popleft()  # waited for: nothing is in flight in this buffer any more, even if drain raises
    drain(at, n, buffer)


def copy_in(nbytes: int, chunk: int, buffers: Sequence[B], start: Callable[[int, int, B], Waitable]) -> None:
    """Copy ``nbytes`` from a source to a destination through ``buffers``: filled, then sent asynchronously.

    ``start(at, n, buffer)`` fills ``buffer`` with source bytes ``[at, at + n)`` and begins the asynchronous
    copy from it to the destination, returning what to wait on. A buffer is refilled only after its last copy
    finished; every copy is waited for before this returns (or raises), so the buffers can be reused.

    Args:
        nbytes: Bytes to copy.
        chunk: Chunk size; every buffer holds at least this many bytes.
        buffers: The staging buffers (at least one).
        start: Fills a buffer with one chunk and begins its copy out.

    Raises:
        ValueError: Without buffers, or for a bad size (see :func:`spans`).
    """
    if not buffers:
        raise ValueError("copy_in needs at least one buffer")
    depth = len(buffers)
    in_flight: collections.deque[Waitable] = collections.deque()  # oldest first
    try:
        for k, (at, n) in enumerate(spans(nbytes, chunk)):
            if len(in_flight) == depth:  # the oldest copy still reads the buffer this chunk needs
                in_flight.popleft().synchronize()
            in_flight.append(start(at, n, buffers[k % depth]))
    finally:
        _wait_all(in_flight)


def _wait_all(events: Iterable[Waitable | None]) -> None:
    """Wait for every event, even if one of the waits raises (the first error is raised after)."""
    error: BaseException | None = None
    for event in list(events):
        if event is None:
            continue
        try:
            event.synchronize()
        except BaseException as exc:  # keep waiting for the others, then raise the first
            error = error or exc
    if error is not None:
        raise error


class BufferPool(Generic[B]):
    """A bounded, thread-safe pool of staging buffers, allocated on first use and reused after.

    A copy leases one *slot*: ``depth`` buffers of ``chunk_bytes`` each, taken together so that two copies
    each holding half of what they need can never wait on each other. At most ``slots`` slots are ever
    allocated, so the pool never holds more than :attr:`bound_bytes`.

    Args:
        allocate: Makes one buffer of the given size (pinned host memory in :mod:`pc_pickle._device_copy`).
        chunk_bytes: Size of each buffer.
        depth: Buffers per slot.
        slots: Slots at most.
    """

    def __init__(
        self,
        allocate: Callable[[int], B],
        chunk_bytes: int = CHUNK_BYTES,
        depth: int = DEPTH,
        slots: int = SLOTS,
    ) -> None:
        if chunk_bytes < 1 or depth < 1 or slots < 1:
            raise ValueError(f"need positive sizes, got {chunk_bytes=}, {depth=}, {slots=}")
        self.chunk_bytes = chunk_bytes
        self.depth = depth
        self.slots = slots
        self._allocate = allocate
        self._free: list[list[B]] = []
        self._made = 0
        self._cond = threading.Condition()

    @property
    def bound_bytes(self) -> int:
        """The most the pool ever holds, in bytes."""
        return self.chunk_bytes * self.depth * self.slots

    @property
    def allocated_bytes(self) -> int:
        """What the pool holds now (leased or free), in bytes."""
        with self._cond:
            return self._made * self.depth * self.chunk_bytes

    @property
    def free_slots(self) -> int:
        """Allocated slots not leased now."""
        with self._cond:
            return len(self._free)

    @contextmanager
    def lease(self, timeout: float) -> Iterator[list[B] | None]:
        """Lease one slot for a ``with`` block; it goes back to the pool when the block ends, even by raising.

        Args:
            timeout: Seconds to wait for a slot when all are leased.

        Yields:
            The slot's buffers, or None when none came free within ``timeout`` (copy without staging then).

        Raises:
            Whatever ``allocate`` raises when a new slot is made (the slot is not counted then).
        """
        buffers = self._acquire(timeout)
        try:
            yield buffers
        finally:
            if buffers is not None:
                with self._cond:
                    self._free.append(buffers)
                    self._cond.notify()

    def _acquire(self, timeout: float) -> list[B] | None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._free:
                if self._made < self.slots:
                    self._made += 1
                    try:
                        return [self._allocate(self.chunk_bytes) for _ in range(self.depth)]
                    except BaseException:
                        self._made -= 1
                        raise
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            return self._free.pop()


class Deferred(mmap.mmap):
    """A placeholder for bytes that are written later, straight into their final destination.

    It is anonymous memory of the right size that stays untouched (so it costs no physical memory) while
    the payload is assembled around it. :func:`pc_pickle._bigbuf.join` recognises it (:func:`deferred_of`)
    and calls :attr:`fill` on the payload's own bytes; a writer that hands pieces to a file calls
    :func:`write_piece`, which hands the bytes to the file chunk by chunk (:attr:`stream`), so the
    placeholder's own memory is never written either.

    Create with ``Deferred(-1, nbytes)`` (nbytes >= 1), then set :attr:`fill` and :attr:`stream`.
    """

    fill: Callable[[memoryview], None]
    """Writes the bytes into a writable byte memoryview of exactly this size."""
    stream: Callable[[Callable[[memoryview], object]], None]
    """Calls a file's ``write`` with the bytes, in order, in chunks; a chunk's view is reused after ``write``
    returns (the ``io`` contract: a file must not keep the buffer it was given)."""


def deferred_of(piece: Any) -> Deferred | None:
    """The :class:`Deferred` a payload piece wraps, if any (the piece is a ``PickleBuffer`` over it)."""
    if isinstance(piece, pickle.PickleBuffer):
        with piece.raw() as view:
            owner = view.obj
        if isinstance(owner, Deferred):
            return owner
    return None


def write_piece(piece: Any, write: Callable[[Any], object]) -> None:
    """Hand one payload piece to a file's ``write``; a deferred piece is streamed without a full-size copy.

    Args:
        piece: A payload piece.
        write: The file's ``write``.
    """
    placeholder = deferred_of(piece)
    if placeholder is None:
        write(piece)
    else:
        placeholder.stream(write)
