"""The c10d transport's receive memory, kept for reuse: blocks that come back once what they hold is freed.

Kept apart from :mod:`pc_distributed.rpc._c10d.frames` (what a frame is and how it travels): this is where the
frames' bytes land, and when that memory may be received into again.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import queue
import threading
import weakref
from typing import TypeAlias

import torch

__all__ = ["Buffers", "bytes_tensor", "carve", "host_view"]

_Back: TypeAlias = "weakref.finalize[[mmap.mmap], memoryview]"  # brings a lent block back once its view dies


class Buffers:
    """Receive memory kept for reuse: blocks of at least ``min_bytes``, up to ``keep_bytes`` idle in all.

    A fresh buffer of megabytes costs a page fault per page on its first write, in the thread of gloo that
    receives into it, and receiving into fresh memory ran at half the speed of receiving into pages already
    there (docs/distributed.md, "RPC backends"). So received bytes land in kept blocks:

    - a part becomes the storage of the tensors it carries, which the receiving code keeps as long as it
      likes: :meth:`lend` hands out a tensor whose block comes back by itself once the last tensor on its
      memory is freed (a finalizer on the buffer object that the tensor's storage holds);
    - a body is unpickled (which copies it) and is then of no more use: :meth:`take` lends it the same way,
      and :meth:`give` brings its block back at once, before the tensor is freed (a body that is never given
      back, as the reply to a call that timed out, still comes back once freed). A block comes back once.

    A request is served by the smallest idle block that fits and is at most twice its size, else a new one (an
    anonymous memory map: page-aligned, and its pages are only touched by the first receive into it). Blocks
    beyond the idle budget are unmapped, the largest first. A block coming back goes on a queue (safe wherever
    the garbage collector runs a finalizer, even in a thread inside this object) and is sorted in at once
    unless another call holds the lock, which sorts it in then or at the next call. :meth:`close` drops the
    idle blocks and every block that comes back later. Safe to share between threads.
    """

    def __init__(self, keep_bytes: int = 64 << 20, min_bytes: int = 64 << 10) -> None:
        self._keep_bytes = keep_bytes
        self._min_bytes = min_bytes
        self._lock = threading.Lock()
        self._free: list[mmap.mmap] = []  # idle blocks, the largest first
        self._taken: dict[int, _Back] = {}  # data pointer of a body from take -> the finalizer of its view
        self._returned: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()  # blocks that came back

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` to receive into, to be given back with :meth:`give` once read."""
        if nbytes < self._min_bytes:
            return torch.empty(nbytes, dtype=torch.uint8)
        body, back = self._lend(nbytes)
        with self._lock:
            self._taken[body.data_ptr()] = back
        return body

    def give(self, body: torch.Tensor | memoryview) -> None:
        """Bring back the block of a body from :meth:`take` now: nothing reads the body any more.

        Bodies that did not come from :meth:`take` (a memoryview is not), or were given back already, are
        ignored.
        """
        if not isinstance(body, torch.Tensor):
            return
        with self._lock:
            back = self._taken.pop(body.data_ptr(), None)
        detached = None if back is None else back.detach()  # None if it came back by itself meanwhile
        if detached is not None:
            self._give_back(detached[2][0])

    def lend(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` whose memory comes back here once no tensor uses it any more."""
        if nbytes < self._min_bytes:
            return torch.empty(nbytes, dtype=torch.uint8)
        return self._lend(nbytes)[0]

    def lend_pieces(
        self, nbytes: int, pieces: list[tuple[int, int]]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Lend ``nbytes`` as one uint8 tensor, and one more over each ``(offset, size)`` piece of it.

        Each piece's tensor has a storage of its own (exactly its bytes), as a part received alone would.
        The memory comes back once no tensor over it, the whole or a piece, is in use any more.

        Raises:
            ValueError: If a piece does not lie within ``nbytes``.
        """
        for offset, size in pieces:
            if offset < 0 or size < 0 or offset + size > nbytes:
                raise ValueError(f"piece (offset {offset}, size {size}) does not lie within {nbytes} bytes")
        view = self.lend_view(nbytes)
        return torch.frombuffer(view, dtype=torch.uint8), carve(view, pieces)

    def lend_view(self, nbytes: int) -> memoryview:
        """``nbytes`` of memory as a writable view, which comes back here once no longer referenced.

        Tensors made over it with ``torch.frombuffer`` reference the view itself: the memory comes back once
        the view and all of them are freed.
        """
        return memoryview(bytearray(nbytes)) if nbytes < self._min_bytes else self._view(nbytes)[0]

    def _lend(self, nbytes: int) -> tuple[torch.Tensor, _Back]:
        view, back = self._view(nbytes)
        return torch.frombuffer(view, dtype=torch.uint8), back

    def _view(self, nbytes: int) -> tuple[memoryview, _Back]:
        """A view of ``nbytes`` of a block, which comes back once the view is no longer referenced."""
        block = self._block(nbytes)
        view = memoryview(block)[:nbytes]  # the tensors' storages hold this view, and it holds the block
        back = weakref.finalize(view, self._give_back, block)
        back.atexit = False
        return view, back

    def idle_bytes(self) -> int:
        """How many bytes the idle blocks hold."""
        with self._lock:
            self._settle_locked()
            return sum(len(b) for b in self._free)

    def close(self) -> None:
        """Unmap the idle blocks, and from now on every block that comes back (take and lend still work)."""
        with self._lock:
            self._keep_bytes = 0
            self._settle_locked()

    def _give_back(self, block: mmap.mmap) -> None:
        self._returned.put(block)
        if self._lock.acquire(blocking=False):  # else its holder sorts it in, or the next call does
            try:
                self._settle_locked()
            finally:
                self._lock.release()

    def _block(self, nbytes: int) -> mmap.mmap:
        with self._lock:
            self._settle_locked()
            # by position, the smallest that fits
            fits = [i for i, b in enumerate(self._free) if nbytes <= len(b) <= 2 * nbytes]
            if fits:
                return self._free.pop(fits[-1])
        return mmap.mmap(-1, nbytes)

    def _settle_locked(self) -> None:
        """Sort the blocks that came back into the idle list, and keep it within the budget."""
        came = []
        while True:
            try:
                came.append(self._returned.get_nowait())
            except queue.Empty:
                break
        if came:
            self._free = sorted(self._free + came, key=len, reverse=True)
            # bodies never given back (their blocks came back by themselves) are forgotten
            self._taken = {address: back for address, back in self._taken.items() if back.alive}
        idle = sum(len(b) for b in self._free)
        while idle > self._keep_bytes:
            idle -= len(self._free.pop(0))  # the largest goes first; unmapped once unreferenced


def carve(view: memoryview, pieces: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
    """One uint8 tensor over each ``(offset, size)`` piece of ``view``, each with a storage of its own.

    Every tensor made by ``torch.frombuffer`` over the view holds the view itself (not a copy of it), so a
    finalizer on the view (:meth:`Buffers.lend_view`) runs once the last of them is freed.
    """
    return tuple(
        torch.frombuffer(view, dtype=torch.uint8, count=size, offset=offset) for offset, size in pieces
    )


def host_view(data: torch.Tensor | torch.UntypedStorage | memoryview) -> memoryview:
    """The bytes of a contiguous host tensor or a host storage (a memoryview as it is), as a memoryview.

    Made without a tensor op: torch releases the GIL in each op (``Tensor.numpy`` too), and a thread that
    releases it while others want it waits for them to give it back, up to the interpreter's switch interval
    (5 ms by default), which on the transport's threads is one context switch or more per message. Reading
    the data pointer does not release it. The view keeps ``data`` alive.
    """
    if isinstance(data, memoryview):
        return data
    nbytes = data.nbytes() if isinstance(data, torch.UntypedStorage) else data.numel() * data.element_size()
    if not nbytes:
        return memoryview(b"")
    array = _bytes_type(nbytes).from_address(data.data_ptr())
    array.owner = data  # type: ignore[attr-defined]  # the view holds the array, the array the memory
    return memoryview(array).cast("B")


def bytes_tensor(data: bytes) -> torch.Tensor:
    """A uint8 tensor over the bytes of ``data``, without copying them; the tensor keeps ``data`` alive.

    ``torch.frombuffer`` warns once per process about a read-only buffer such as ``bytes``; gloo only reads a
    tensor it sends, so the tensor is made over a writable ctypes view of the same memory instead (a
    ``c_char_p`` made from ``bytes`` points at the object's own buffer).
    """
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    array = _bytes_type(len(data)).from_address(
        ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
    )
    array.owner = data  # type: ignore[attr-defined]  # the tensor holds the array, the array the bytes
    return torch.frombuffer(array, dtype=torch.uint8)


@functools.lru_cache(maxsize=256)
def _bytes_type(nbytes: int) -> type[ctypes.Array[ctypes.c_char]]:
    """The ctypes array type of ``nbytes`` chars, kept for the sizes used last.

    Making a type costs more than the rest of :func:`host_view`, and messages repeat their sizes.
    """
    return ctypes.c_char * nbytes
