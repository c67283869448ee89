"""Staging of large copies in dumps and loads: the whole path with the CPU standing in for the device (fake
events, ordinary buffers), and the real CUDA path (``gpu``)."""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from pickle_staging_testutils import CountingAllocator, DoneEvent

import pc_pickle
from pc_pickle import _device_copy, _staging, _tensors
from pc_pickle._staging import BufferPool


# -- dumps and loads with the CPU standing in for the device -----------------------------------------------
@pytest.fixture
def cpu_staging(monkeypatch: pytest.MonkeyPatch) -> Iterator[BufferPool[torch.Tensor]]:
    """Stage CPU storages as if they were on a device, through a small pool of ordinary buffers."""
    pool = BufferPool(CountingAllocator(), chunk_bytes=256 << 10, depth=2, slots=2)
    monkeypatch.setattr(_device_copy, "STAGED_DEVICE_TYPES", ("cpu", "cuda"))
    monkeypatch.setattr(_device_copy, "_record_event", DoneEvent)
    monkeypatch.setattr(_device_copy, "_pool", pool)
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
    monkeypatch.setattr(_device_copy, "STAGED_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(_device_copy, "_record_event", DoneEvent)
    monkeypatch.setattr(_device_copy, "_pool", pool)
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
    stage = _device_copy.stage_to_host

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


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_staged_loads_reads_the_payload_in_place(
    kind: Callable[[bytes], object], cpu_staging: BufferPool[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A staged storage is copied to the device from a view of the payload itself, not from a host copy."""
    sources: list[memoryview] = []
    stage = _device_copy.stage_to_device

    def spy(source: memoryview, device: torch.device) -> torch.UntypedStorage:
        sources.append(source)
        return stage(source, device)

    monkeypatch.setattr(_tensors, "stage_to_device", spy)
    tensor = torch.randn(1 << 20)
    other = torch.arange(300_001, dtype=torch.float64)
    payload = kind(pc_pickle.dumps({"t": tensor, "view": tensor[3:], "other": other}))
    owner = payload.obj if isinstance(payload, memoryview) else payload
    out = pc_pickle.loads(payload)  # type: ignore[arg-type]
    assert [len(s) for s in sources] == [tensor.nbytes, other.nbytes]
    assert all(isinstance(s, memoryview) and s.obj is owner for s in sources)  # views of the payload
    assert all(s.readonly == isinstance(owner, bytes) for s in sources)
    assert torch.equal(torch.frombuffer(bytearray(sources[0]), dtype=torch.float32), tensor)
    assert torch.equal(out["t"], tensor)
    assert torch.equal(out["view"], tensor[3:])
    assert out["view"].untyped_storage().data_ptr() == out["t"].untyped_storage().data_ptr()
    assert torch.equal(out["other"], other)
    assert cpu_staging.free_slots * 2 * cpu_staging.chunk_bytes == cpu_staging.allocated_bytes


@pytest.mark.parametrize("writable", [True, False], ids=["writable", "read-only"])
@pytest.mark.parametrize("busy", [False, True], ids=["staged", "pool-busy"])
def test_stage_to_device_copies_a_view_exactly(
    writable: bool, busy: bool, cpu_staging: BufferPool[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both source kinds (torch's copy, memoryview copy) and the unstaged fallback give the same bytes."""
    monkeypatch.setattr(_device_copy, "LEASE_TIMEOUT_S", 0.01)
    raw = torch.randint(0, 256, (5 * cpu_staging.chunk_bytes + 77,), dtype=torch.uint8)
    data = bytes(_device_copy._bytes_of(raw))
    source = memoryview(bytearray(data) if writable else data)[5:]
    with contextlib.ExitStack() as held:
        for _ in range(2 if busy else 1):  # the pool has 2 slots: leave one free, or none
            assert held.enter_context(cpu_staging.lease(1.0)) is not None
        made = cpu_staging.allocated_bytes
        out = _device_copy.stage_to_device(source, torch.device("cpu"))
        assert cpu_staging.allocated_bytes == (made if busy else cpu_staging.bound_bytes)
    assert bytes(_device_copy._bytes_of(torch.empty(0, dtype=torch.uint8).set_(out))) == data[5:]


_PEAK_PROBE = """
import torch, pc_pickle
from pc_pickle import _device_copy
from pc_pickle._staging import BufferPool
from pickle_staging_testutils import CountingAllocator, DoneEvent

_device_copy.STAGED_DEVICE_TYPES = ("cpu",)
_device_copy._record_event = DoneEvent
_device_copy._pool = BufferPool(CountingAllocator(), chunk_bytes=1 << 20, depth=2, slots=1)
size = 64 << 20
payload = pc_pickle.dumps(torch.ones(size // 4))

def kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the current resident size
before = kib("VmRSS")
out = pc_pickle.loads(payload)
grew = (kib("VmHWM") - before) * 1024 / size
assert torch.equal(out, torch.ones(size // 4))
print(grew)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_staged_loads_peak_host_memory_is_the_storage_not_twice() -> None:
    """Loading a staged 64 MiB storage (the "device" is the CPU here, so its copy is host memory too) raises
    the peak resident size by about the storage, not by the storage plus a full-size copy of its bytes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0 and "clear_refs" in done.stderr:
        pytest.skip(f"cannot reset the peak resident size: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr
    grew = float(done.stdout)
    assert 0.9 < grew < 1.5  # the storage (1x) and the pool (2 MiB); the old full-size copy made it 2x


def test_tensor_over_a_read_only_view_is_the_same_memory() -> None:
    """The payload ``bytes`` are read by torch in place: no copy, no non-writable-buffer warning."""
    data = bytes(range(256)) * 10
    start = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
    assert start is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tensor = _device_copy._tensor_over(memoryview(data)[7:1007])
    assert tensor.data_ptr() == start + 7
    assert tensor.numel() == 1000
    assert bytes(_device_copy._bytes_of(tensor.clone())) == data[7:1007]
    writable = bytearray(data)
    assert _device_copy._tensor_over(memoryview(writable)[3:]).data_ptr() == _tensors._address(writable) + 3


def test_a_region_no_storage_takes_is_refused(
    cpu_staging: BufferPool[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lent region left unfilled would be a storage of wrong bytes: the load fails loudly instead."""
    payload = pc_pickle.dumps(torch.randn(1 << 20))
    monkeypatch.setattr(_tensors.LentRegions, "take", lambda self, data: None)
    with pytest.raises(pc_pickle.PayloadError, match="outside the storage table"):
        pc_pickle.loads(payload)


def test_loaded_storages_do_not_alias_the_payload(cpu_staging: BufferPool[torch.Tensor]) -> None:
    """Read in place, yet copied: changing the payload after loads changes no tensor (staged or not)."""
    staged, plain = torch.randn(1 << 20), torch.randn(50_000)  # 4 MiB staged, 200 kB a raw region unstaged
    payload = bytearray(pc_pickle.dumps([staged, plain]))
    out = pc_pickle.loads(payload)
    payload[:] = bytes(len(payload))
    assert torch.equal(out[0], staged)
    assert torch.equal(out[1], plain)
    out[1].add_(1)  # a CPU storage is writable and its own
    assert torch.equal(out[1], plain + 1)


def test_staged_pickler_writes_to_a_file(cpu_staging: BufferPool[torch.Tensor]) -> None:
    tensor = torch.randn(600_000)
    buf = io.BytesIO()
    pc_pickle.Pickler(buf, copy_tensor=True).dump([tensor, tensor[5:]])
    out = pc_pickle.loads(buf.getvalue())
    assert torch.equal(out[0], tensor)
    assert torch.equal(out[1], tensor[5:])


class _RecordingFile:
    """A binary file that copies what each ``write`` gets (as the ``io`` contract allows) and its size."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: object) -> int:
        self.parts.append(bytes(memoryview(data)))  # type: ignore[arg-type]
        return len(self.parts[-1])


@pytest.mark.parametrize("busy", [False, True], ids=["staged", "pool-busy"])
def test_staged_pickler_streams_chunks_to_its_file(
    busy: bool, cpu_staging: BufferPool[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A staged storage reaches the file in pinned-buffer chunks, never as one full-size host copy."""
    monkeypatch.setattr(_device_copy, "LEASE_TIMEOUT_S", 0.01)
    tensor = torch.randn(1 << 20)  # 4 MiB: 16 chunks of 256 KiB
    file = _RecordingFile()
    with contextlib.ExitStack() as held:
        for _ in range(2 if busy else 0):
            assert held.enter_context(cpu_staging.lease(1.0)) is not None
        pc_pickle.Pickler(file, copy_tensor=True).dump(tensor)  # type: ignore[arg-type]
    sizes = [len(part) for part in file.parts]
    if busy:
        assert tensor.nbytes in sizes  # the unstaged fallback writes it at once
    else:
        assert max(sizes) <= cpu_staging.chunk_bytes
        assert sizes.count(cpu_staging.chunk_bytes) == tensor.nbytes // cpu_staging.chunk_bytes
    payload = b"".join(file.parts)
    monkeypatch.setattr(_device_copy, "STAGED_DEVICE_TYPES", ())
    assert payload == pc_pickle.dumps(tensor)  # the same bytes as an unstaged dumps
    assert torch.equal(pc_pickle.loads(payload), tensor)


def test_small_storages_are_not_staged(cpu_staging: BufferPool[torch.Tensor]) -> None:
    pc_pickle.loads(pc_pickle.dumps(torch.ones(1000)))
    assert cpu_staging.allocated_bytes == 0


def test_staging_falls_back_to_a_plain_copy_when_the_pool_is_busy(
    cpu_staging: BufferPool[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_device_copy, "LEASE_TIMEOUT_S", 0.01)
    tensor = torch.randn(1 << 20)
    with cpu_staging.lease(1.0) as a, cpu_staging.lease(1.0) as b:
        assert a is not None
        assert b is not None
        assert torch.equal(pc_pickle.loads(pc_pickle.dumps(tensor)), tensor)


def test_staging_falls_back_when_pinned_memory_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_device_copy, "STAGED_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(_device_copy, "_pool", BufferPool(CountingAllocator(fail=True)))
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
        "from pc_pickle import _device_copy\n"
        "pc_pickle.loads(pc_pickle.dumps(torch.randn(1 << 20)))\n"
        "assert _device_copy._pool is None, 'pool made'\n"
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
    monkeypatch.setattr(_device_copy, "STAGED_DEVICE_TYPES", ())
    assert pc_pickle.dumps({"t": tensor}) == staged  # the same bytes as the unstaged copy


def _to_cuda_view(host: torch.Tensor) -> torch.Tensor:
    """The same view (shape, stride, offset) of a copy of ``host``'s whole storage on cuda:0."""
    base = host.untyped_storage()
    storage = torch.empty((0,), dtype=torch.uint8).set_(base).cuda().untyped_storage()
    return torch.empty((0,), dtype=host.dtype, device="cuda").set_(
        storage, host.storage_offset(), host.shape, host.stride()
    )


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [bytes, bytearray])
def test_cuda_loads_stages_from_the_payload_in_place(
    kind: Callable[[bytes], object], monkeypatch: pytest.MonkeyPatch
) -> None:
    sources: list[memoryview] = []
    stage = _device_copy.stage_to_device

    def spy(source: memoryview, device: torch.device) -> torch.UntypedStorage:
        sources.append(source)
        return stage(source, device)

    monkeypatch.setattr(_tensors, "stage_to_device", spy)
    tensor = torch.randn(20_000_003, device="cuda")  # several 16 MB chunks, a short last one
    payload = kind(pc_pickle.dumps(tensor))
    out = pc_pickle.loads(payload)  # type: ignore[arg-type]
    assert len(sources) == 1
    assert sources[0].obj is payload
    assert out.device == tensor.device
    assert torch.equal(out, tensor)


@pytest.mark.gpu
def test_cuda_pinned_pool_stays_bounded_under_threads() -> None:
    pool = _device_copy.staging_pool()
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
    monkeypatch.setattr(_device_copy, "_record_event", failing_event)
    with pytest.raises(RuntimeError, match="device copy failed"):
        run()
    assert calls == 3
    assert cpu_staging.allocated_bytes > 0
    assert cpu_staging.free_slots * 2 * cpu_staging.chunk_bytes == cpu_staging.allocated_bytes
    monkeypatch.setattr(_device_copy, "_record_event", DoneEvent)
    assert torch.equal(pc_pickle.loads(pc_pickle.dumps(tensor)), tensor)  # the pool still works
