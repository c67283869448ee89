"""Staging of large copies through pinned chunks: the planner, the pipelines and the pool, on the CPU with
fake asynchronous copies (the dumps/loads path and the CUDA path: test_pickle_staging_payload.py)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import pytest
import torch
from pickle_staging_testutils import CountingAllocator

from pc_pickle._staging import BufferPool, copy_in, copy_out, spans

CHUNK = 1000


class LazyCopy:
    """A fake asynchronous copy: the bytes move only when it is waited for, as a real one may.

    A pipeline that reads a buffer before waiting, or refills it before its copy ran, gets wrong bytes.
    """

    def __init__(self, log: list[str], name: str, copy: Callable[[], None]) -> None:
        self.log = log
        self.name = name
        self._copy: Callable[[], None] | None = copy

    def synchronize(self) -> None:
        if self._copy is not None:
            self._copy()
            self._copy = None
            self.log.append(f"wait {self.name}")


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _source(nbytes: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8)


def _buffers(depth: int = 2, size: int = CHUNK) -> list[torch.Tensor]:
    return [torch.full((size,), 0xEE, dtype=torch.uint8) for _ in range(depth)]


def _run_copy_out(source: torch.Tensor, depth: int = 2) -> tuple[torch.Tensor, list[str]]:
    dest = torch.zeros_like(source)
    log: list[str] = []
    buffers = _buffers(depth)

    def start(at: int, n: int, buf: torch.Tensor) -> LazyCopy:
        log.append(f"start {at}")
        return LazyCopy(log, str(at), lambda: buf[:n].copy_(source[at : at + n]))

    def drain(at: int, n: int, buf: torch.Tensor) -> None:
        log.append(f"drain {at}")
        dest[at : at + n].copy_(buf[:n])

    copy_out(source.numel(), CHUNK, buffers, start, drain)
    return dest, log


def _run_copy_in(source: torch.Tensor, depth: int = 2) -> tuple[torch.Tensor, list[str]]:
    dest = torch.zeros_like(source)
    log: list[str] = []
    buffers = _buffers(depth)

    def start(at: int, n: int, buf: torch.Tensor) -> LazyCopy:
        log.append(f"start {at}")
        buf[:n].copy_(source[at : at + n])  # the host side: filled now
        return LazyCopy(log, str(at), lambda: dest[at : at + n].copy_(buf[:n]))  # the device side: later

    copy_in(source.numel(), CHUNK, buffers, start)
    return dest, log


# -- the planner -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [
        (0, []),
        (1, [(0, 1)]),
        (CHUNK - 1, [(0, CHUNK - 1)]),
        (CHUNK, [(0, CHUNK)]),
        (CHUNK + 1, [(0, CHUNK), (CHUNK, 1)]),
        (3 * CHUNK, [(0, CHUNK), (CHUNK, CHUNK), (2 * CHUNK, CHUNK)]),
        (2 * CHUNK + 7, [(0, CHUNK), (CHUNK, CHUNK), (2 * CHUNK, 7)]),
    ],
)
def test_spans_cover_every_byte_once(nbytes: int, expected: list[tuple[int, int]]) -> None:
    assert spans(nbytes, CHUNK) == expected


def test_spans_of_many_chunks_are_contiguous() -> None:
    plan = spans(123_457, 64)
    assert plan[0][0] == 0
    assert all(n == 64 for _, n in plan[:-1])
    assert plan[-1][1] == 123_457 % 64
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(plan))
    assert sum(n for _, n in plan) == 123_457


@pytest.mark.parametrize(("nbytes", "chunk"), [(-1, 10), (10, 0)])
def test_spans_refuses_bad_sizes(nbytes: int, chunk: int) -> None:
    with pytest.raises(ValueError, match="nbytes"):
        spans(nbytes, chunk)


# -- the pipelines ---------------------------------------------------------------------------------------
SIZES = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 5 * CHUNK, 7 * CHUNK + 333]


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_copy_out_moves_every_byte(nbytes: int, depth: int) -> None:
    source = _source(nbytes)
    dest, log = _run_copy_out(source, depth)
    assert torch.equal(dest, source)
    assert sum(line.startswith("drain") for line in log) == len(spans(nbytes, CHUNK))


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_copy_in_moves_every_byte(nbytes: int, depth: int) -> None:
    source = _source(nbytes)
    dest, log = _run_copy_in(source, depth)
    assert torch.equal(dest, source)
    assert sum(line.startswith("wait") for line in log) == len(spans(nbytes, CHUNK))


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12345, dtype=torch.float64) / 7,
        torch.arange(999, dtype=torch.int16),  # an odd byte count is impossible for int16; 1998 bytes
        torch.randn(31, 17, dtype=torch.complex64),
        torch.randn(1001).to(torch.bfloat16),
        torch.tensor([True, False, True] * 337),  # 1011 bytes
        torch.arange(2 * CHUNK + 3, dtype=torch.uint8),
    ],
    ids=["float64", "int16", "complex64", "bfloat16", "bool-odd", "uint8-odd"],
)
def test_pipelines_round_trip_dtypes(tensor: torch.Tensor) -> None:
    raw = _bytes_of(tensor)
    out, _ = _run_copy_out(raw)
    back, _ = _run_copy_in(out)
    assert torch.equal(back.view(tensor.dtype).view(tensor.shape), tensor)


def test_copy_out_overlaps_the_next_copy_with_the_drain() -> None:
    _, log = _run_copy_out(_source(3 * CHUNK))
    assert log == [
        "start 0",
        f"start {CHUNK}",  # chunk 1 is in flight ...
        "wait 0",
        "drain 0",  # ... while chunk 0 is drained
        f"start {2 * CHUNK}",
        f"wait {CHUNK}",
        f"drain {CHUNK}",
        f"wait {2 * CHUNK}",
        f"drain {2 * CHUNK}",
    ]


def test_copy_in_waits_only_before_reuse_and_at_the_end() -> None:
    _, log = _run_copy_in(_source(3 * CHUNK))
    assert log == [
        "start 0",
        f"start {CHUNK}",
        "wait 0",
        f"start {2 * CHUNK}",
        f"wait {CHUNK}",
        f"wait {2 * CHUNK}",
    ]


@pytest.mark.parametrize("where", ["start", "drain"])
def test_copy_out_failure_waits_for_copies_in_flight(where: str) -> None:
    events: list[LazyCopy] = []
    log: list[str] = []

    def start(at: int, n: int, buf: torch.Tensor) -> LazyCopy:
        if where == "start" and at == 2 * CHUNK:
            raise RuntimeError("copy failed")
        events.append(LazyCopy(log, str(at), lambda: None))
        return events[-1]

    def drain(at: int, n: int, buf: torch.Tensor) -> None:
        if where == "drain" and at == CHUNK:
            raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError, match="copy failed"):
        copy_out(5 * CHUNK, CHUNK, _buffers(), start, drain)
    assert events
    assert all(e._copy is None for e in events)


def test_copy_in_failure_waits_for_copies_in_flight() -> None:
    events: list[LazyCopy] = []

    def start(at: int, n: int, buf: torch.Tensor) -> LazyCopy:
        if at == 3 * CHUNK:
            raise RuntimeError("copy failed")
        events.append(LazyCopy([], str(at), lambda: None))
        return events[-1]

    with pytest.raises(RuntimeError, match="copy failed"):
        copy_in(5 * CHUNK, CHUNK, _buffers(), start)
    assert len(events) == 3
    assert all(e._copy is None for e in events)


def test_pipelines_need_a_buffer() -> None:
    with pytest.raises(ValueError, match="buffer"):
        copy_out(10, CHUNK, [], lambda *a: LazyCopy([], "", lambda: None), lambda *a: None)
    with pytest.raises(ValueError, match="buffer"):
        copy_in(10, CHUNK, [], lambda *a: LazyCopy([], "", lambda: None))


# -- the pool --------------------------------------------------------------------------------------------
def test_pool_allocates_lazily_and_reuses_buffers() -> None:
    alloc = CountingAllocator()
    pool = BufferPool(alloc, chunk_bytes=CHUNK, depth=2, slots=2)
    assert alloc.made == 0
    assert pool.allocated_bytes == 0
    assert pool.bound_bytes == 4 * CHUNK
    with pool.lease(1.0) as first:
        assert first is not None
        assert len(first) == 2
        assert first[0].numel() == CHUNK
        ids = [id(b) for b in first]
    with pool.lease(1.0) as again:
        assert again is not None
        assert [id(b) for b in again] == ids
    assert alloc.made == 2
    assert pool.allocated_bytes == 2 * CHUNK
    assert pool.free_slots == 1


def test_pool_never_exceeds_its_bound_and_times_out_when_full() -> None:
    alloc = CountingAllocator()
    pool = BufferPool(alloc, chunk_bytes=CHUNK, depth=2, slots=2)
    with pool.lease(1.0) as a, pool.lease(1.0) as b:
        assert a is not None
        assert b is not None
        with pool.lease(0.05) as c:
            assert c is None  # full: the caller copies without staging
    assert alloc.made == 4
    assert pool.allocated_bytes == pool.bound_bytes
    assert pool.free_slots == 2


def test_pool_slot_comes_back_when_the_block_raises() -> None:
    pool = BufferPool(CountingAllocator(), chunk_bytes=CHUNK, depth=2, slots=1)
    with pytest.raises(RuntimeError, match="boom"), pool.lease(1.0):
        raise RuntimeError("boom")
    assert pool.free_slots == 1
    with pool.lease(0.05) as again:
        assert again is not None


def test_pool_allocation_failure_is_not_counted() -> None:
    alloc = CountingAllocator(fail=True)
    pool = BufferPool(alloc, chunk_bytes=CHUNK, depth=2, slots=1)
    with pytest.raises(RuntimeError, match="cannot pin"), pool.lease(1.0):
        pass
    alloc.fail = False
    with pool.lease(1.0) as buffers:
        assert buffers is not None
    assert pool.allocated_bytes == 2 * CHUNK


def test_pool_is_shared_safely_by_threads() -> None:
    alloc = CountingAllocator()
    pool = BufferPool(alloc, chunk_bytes=CHUNK, depth=2, slots=2)
    held = 0
    most = 0
    lock = threading.Lock()
    errors: list[BaseException] = []
    barrier = threading.Barrier(8, timeout=30)

    def worker() -> None:
        nonlocal held, most
        try:
            barrier.wait()
            for _ in range(50):
                with pool.lease(30.0) as buffers:
                    assert buffers is not None
                    with lock:
                        held += 1
                        most = max(most, held)
                    source = _source(3 * CHUNK + 5)
                    dest = torch.zeros_like(source)
                    copy_out(source.numel(), CHUNK, buffers, _sync_start(source), _drain_to(dest))
                    assert torch.equal(dest, source)
                    with lock:
                        held -= 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert not any(t.is_alive() for t in threads)
    assert most <= 2
    assert alloc.made <= 4
    assert pool.allocated_bytes <= pool.bound_bytes


def _sync_start(source: torch.Tensor) -> Callable[[int, int, torch.Tensor], LazyCopy]:
    def start(at: int, n: int, buf: torch.Tensor) -> LazyCopy:
        return LazyCopy([], str(at), lambda: buf[:n].copy_(source[at : at + n]))

    return start


def _drain_to(dest: torch.Tensor) -> Callable[[int, int, torch.Tensor], None]:
    def drain(at: int, n: int, buf: torch.Tensor) -> None:
        dest[at : at + n].copy_(buf[:n])

    return drain


def test_bounds_of_the_default_pool() -> None:
    pool = BufferPool(CountingAllocator())
    assert pool.bound_bytes <= 64 << 20
    assert pool.depth >= 2
