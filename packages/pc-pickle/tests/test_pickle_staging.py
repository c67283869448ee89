"""Staging of large copies through pinned chunks: the planner, the pipelines and the pool on the CPU with
fake asynchronous copies, the whole dumps/loads path with the CPU standing in for the device, and the real
CUDA path (``gpu``)."""

from __future__ import annotations

import ctypes
import io
import itertools
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

import pc_pickle
from pc_pickle import _staging, _tensors
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
class CountingAllocator:
    """Makes CPU buffers and counts them (thread-safe)."""

    def __init__(self, fail: bool = False) -> None:
        self.made = 0
        self.fail = fail
        self._lock = threading.Lock()

    def __call__(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            if self.fail:
                raise RuntimeError("cannot pin memory")
            self.made += 1
        return torch.empty((nbytes,), dtype=torch.uint8)


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


# -- dumps and loads with the CPU standing in for the device -----------------------------------------------
class DoneEvent:
    def synchronize(self) -> None:
        pass


@pytest.fixture
def cpu_staging(monkeypatch: pytest.MonkeyPatch) -> Iterator[BufferPool[torch.Tensor]]:
    """Stage CPU storages as if they were on a device, through a small pool of ordinary buffers."""
    pool = BufferPool(CountingAllocator(), chunk_bytes=256 << 10, depth=2, slots=2)
    monkeypatch.setattr(_tensors, "STAGED_DEVICE_TYPES", ("cpu", "cuda"))
    monkeypatch.setattr(_tensors, "_record_event", DoneEvent)
    monkeypatch.setattr(_tensors, "_pool", pool)
    return pool


STAGED = [
    torch.arange(1 << 18, dtype=torch.float32),  # exactly 4 chunks
    torch.randn(300_001, dtype=torch.float64),  # many chunks, a short last one
    torch.randn(700, 900).t(),  # a transposed view
    torch.arange(3_000_000, dtype=torch.int8)[1::3],  # a strided view with an offset, odd byte count
    torch.randn(1 << 19).to(torch.bfloat16),
]


@pytest.mark.parametrize("tensor", STAGED, ids=["f32", "f64", "transposed", "int8-strided", "bf16"])
def test_staged_dumps_payload_equals_the_plain_one(
    tensor: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = pc_pickle.dumps({"t": tensor, "again": tensor})
    pool = BufferPool(CountingAllocator(), chunk_bytes=256 << 10, depth=2, slots=2)
    monkeypatch.setattr(_tensors, "STAGED_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(_tensors, "_record_event", DoneEvent)
    monkeypatch.setattr(_tensors, "_pool", pool)
    staged = pc_pickle.dumps({"t": tensor, "again": tensor})
    assert staged == plain
    out = pc_pickle.loads(staged)
    assert torch.equal(out["t"], tensor)
    assert out["t"].stride() == tensor.stride()
    assert out["again"].untyped_storage().data_ptr() == out["t"].untyped_storage().data_ptr()
    assert pool.allocated_bytes > 0
    assert pool.free_slots == pool.allocated_bytes // (2 * pool.chunk_bytes)


def test_staged_chunks_are_written_into_the_final_payload(
    cpu_staging: BufferPool[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    targets: list[tuple[int, int]] = []
    stage = _tensors.stage_to_host

    def spy(source: torch.Tensor, dest: memoryview) -> None:
        targets.append((ctypes.addressof(ctypes.c_char.from_buffer(dest)), len(dest)))
        stage(source, dest)

    monkeypatch.setattr(_tensors, "stage_to_host", spy)
    tensor = torch.randn(1 << 20)
    data = pc_pickle.dumps(tensor)
    start = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
    assert start is not None
    assert len(targets) == 1
    at, size = targets[0]
    assert size == tensor.nbytes
    assert start <= at
    assert at + size <= start + len(data)
    assert torch.equal(pc_pickle.loads(data), tensor)


def test_staged_pickler_writes_to_a_file(cpu_staging: BufferPool[torch.Tensor]) -> None:
    tensor = torch.randn(600_000)
    buf = io.BytesIO()
    pc_pickle.Pickler(buf, copy_tensor=True).dump([tensor, tensor[5:]])
    out = pc_pickle.loads(buf.getvalue())
    assert torch.equal(out[0], tensor)
    assert torch.equal(out[1], tensor[5:])


def test_small_storages_are_not_staged(cpu_staging: BufferPool[torch.Tensor]) -> None:
    pc_pickle.loads(pc_pickle.dumps(torch.ones(1000)))
    assert cpu_staging.allocated_bytes == 0


def test_staging_falls_back_to_a_plain_copy_when_the_pool_is_busy(
    cpu_staging: BufferPool[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_tensors, "LEASE_TIMEOUT_S", 0.01)
    tensor = torch.randn(1 << 20)
    with cpu_staging.lease(1.0) as a, cpu_staging.lease(1.0) as b:
        assert a is not None
        assert b is not None
        assert torch.equal(pc_pickle.loads(pc_pickle.dumps(tensor)), tensor)


def test_staging_falls_back_when_pinned_memory_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_tensors, "STAGED_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(_tensors, "_pool", BufferPool(CountingAllocator(fail=True)))
    tensor = torch.randn(1 << 20)
    assert torch.equal(pc_pickle.loads(pc_pickle.dumps(tensor)), tensor)


def test_threads_dump_and_load_concurrently_through_the_pool(cpu_staging: BufferPool[torch.Tensor]) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(6, timeout=30)

    def worker(seed: int) -> None:
        try:
            barrier.wait()
            gen = torch.Generator().manual_seed(seed)
            for _ in range(4):
                tensor = torch.randn(400_000 + seed, generator=gen)
                assert torch.equal(pc_pickle.loads(pc_pickle.dumps(tensor)), tensor)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert not any(t.is_alive() for t in threads)
    assert cpu_staging.allocated_bytes <= cpu_staging.bound_bytes
    assert cpu_staging.free_slots * 2 * cpu_staging.chunk_bytes == cpu_staging.allocated_bytes


def test_import_and_cpu_dumps_make_no_pool() -> None:
    code = (
        "import torch, pc_pickle\n"
        "from pc_pickle import _tensors\n"
        "pc_pickle.loads(pc_pickle.dumps(torch.randn(1 << 20)))\n"
        "assert _tensors._pool is None, 'pool made'\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_deferred_of_ignores_ordinary_pieces() -> None:
    assert _staging.deferred_of(b"abc") is None
    assert _staging.deferred_of(memoryview(bytearray(4))) is None


# -- the CUDA path ---------------------------------------------------------------------------------------
def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


CUDA_CASES: dict[str, Callable[[], torch.Tensor]] = {
    "1MiB-smallest-staged": lambda: torch.randn(1 << 18, generator=_gen()),
    "one-chunk": lambda: torch.randn((16 << 20) // 8, generator=_gen(), dtype=torch.float64),
    "chunk+1": lambda: torch.randint(0, 255, ((16 << 20) + 1,), generator=_gen(), dtype=torch.uint8),
    "many-chunks": lambda: torch.randn(5_000_003, generator=_gen()),
    "transposed": lambda: torch.randn(3000, 4001, generator=_gen()).t(),
    "bf16-strided": lambda: torch.randn(4_000_000, generator=_gen()).to(torch.bfloat16)[3::2],
    "complex64": lambda: torch.randn(2_000_000, generator=_gen(), dtype=torch.complex64),
    "bool-odd": lambda: torch.randint(0, 2, (3_000_001,), generator=_gen()).bool(),
    "small": lambda: torch.ones(7),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_cuda_copy_round_trip_is_exact(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    host = CUDA_CASES[case]()
    tensor = _to_cuda_view(host)
    staged = pc_pickle.dumps({"t": tensor})
    out = pc_pickle.loads(staged)["t"]
    assert out.device == tensor.device
    assert out.dtype == tensor.dtype
    assert out.stride() == tensor.stride()
    assert out.storage_offset() == tensor.storage_offset()
    assert torch.equal(out.cpu(), host)
    monkeypatch.setattr(_tensors, "STAGED_DEVICE_TYPES", ())
    assert pc_pickle.dumps({"t": tensor}) == staged  # the same bytes as the unstaged copy


def _to_cuda_view(host: torch.Tensor) -> torch.Tensor:
    """The same view (shape, stride, offset) of a copy of ``host``'s whole storage on cuda:0."""
    base = host.untyped_storage()
    storage = torch.empty((0,), dtype=torch.uint8).set_(base).cuda().untyped_storage()
    return torch.empty((0,), dtype=host.dtype, device="cuda").set_(
        storage, host.storage_offset(), host.shape, host.stride()
    )


@pytest.mark.gpu
def test_cuda_pinned_pool_stays_bounded_under_threads() -> None:
    pool = _tensors.staging_pool()
    errors: list[BaseException] = []
    tensors = [torch.randn(9_000_000 + i, device="cuda") for i in range(4)]

    def worker(t: torch.Tensor) -> None:
        try:
            for _ in range(3):
                assert torch.equal(pc_pickle.loads(pc_pickle.dumps(t)), t)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in tensors]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert not any(t.is_alive() for t in threads)
    assert 0 < pool.allocated_bytes <= pool.bound_bytes <= 64 << 20
    assert pool.free_slots * pool.depth * pool.chunk_bytes == pool.allocated_bytes  # all leases returned
    with pool.lease(1.0) as buffers:
        assert buffers is not None
        assert all(b.is_pinned() for b in buffers)


@pytest.mark.gpu
def test_cuda_pickler_copy_to_a_file_is_exact() -> None:
    tensor = torch.randn(3_000_000, device="cuda")
    buf = io.BytesIO()
    pc_pickle.Pickler(buf, copy_tensor=True).dump(tensor)
    assert torch.equal(pc_pickle.loads(buf.getvalue()), tensor)


@pytest.mark.parametrize("path", ["dumps", "Pickler", "loads"])
def test_a_copy_failing_mid_way_raises_and_returns_its_buffers(
    path: str, cpu_staging: BufferPool[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    tensor = torch.randn(1 << 20)  # 4 MiB: 16 chunks of 256 KiB
    payload = pc_pickle.dumps(tensor) if path == "loads" else b""
    calls = 0

    def failing_event() -> DoneEvent:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("device copy failed")
        return DoneEvent()

    run: Callable[[], object] = {
        "dumps": lambda: pc_pickle.dumps(tensor),
        "Pickler": lambda: pc_pickle.Pickler(io.BytesIO(), copy_tensor=True).dump(tensor),
        "loads": lambda: pc_pickle.loads(payload),
    }[path]
    monkeypatch.setattr(_tensors, "_record_event", failing_event)
    with pytest.raises(RuntimeError, match="device copy failed"):
        run()
    assert calls == 3
    assert cpu_staging.allocated_bytes > 0
    assert cpu_staging.free_slots * 2 * cpu_staging.chunk_bytes == cpu_staging.allocated_bytes
    monkeypatch.setattr(_tensors, "_record_event", DoneEvent)
    assert torch.equal(pc_pickle.loads(pc_pickle.dumps(tensor)), tensor)  # the pool still works
