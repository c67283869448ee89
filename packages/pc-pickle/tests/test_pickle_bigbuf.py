"""The copy path's large buffers: the huge-page join equals ``b"".join``; big tensors load from any input."""

from __future__ import annotations

import concurrent.futures
import ctypes
import itertools
import pickle
import threading

import pytest
import torch

import pc_pickle
from pc_pickle import _bigbuf
from pc_pickle._bigbuf import HUGE_MIN, POPULATE_MIN, join, populate


@pytest.mark.parametrize(
    "total", [0, 10, HUGE_MIN - 1, HUGE_MIN, 3 * HUGE_MIN + 12345, POPULATE_MIN + 3 * HUGE_MIN + 777]
)
def test_pickle_join_equals_bytes_join(total: int) -> None:
    raw = bytes(range(256)) * (total // 256 + 1)
    head, big = raw[:7], bytearray(raw[7:total])
    pieces = [head, pickle.PickleBuffer(big), memoryview(b"tail")]
    out = join(pieces)
    assert type(out) is bytes
    assert out == b"".join([head, bytes(big), b"tail"])
    assert hash(out) == hash(bytes(out))  # a finished, ordinary bytes object


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_pickle_big_tensor_round_trips_through_every_input_type(kind: type) -> None:
    t = torch.arange(3 * HUGE_MIN // 4, dtype=torch.float32)  # 3x the advised size
    obj = {"w": t, "view": t[10:20], "n": 3}
    payload = pc_pickle.dumps(obj)
    out = pc_pickle.loads(kind(payload))
    assert torch.equal(out["w"], t)
    assert out["view"].untyped_storage().data_ptr() == out["w"].untyped_storage().data_ptr()
    out["w"][0] = -1.0  # the loaded storage is writable and not the payload's memory
    assert payload == pc_pickle.dumps(obj)


def test_pickle_populate_faults_in_every_share_but_the_writers_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[int, int, int]] = []
    lock = threading.Lock()

    def recording_madvise(address: int, length: int, advice: int) -> int:
        with lock:
            calls.append((address, length, advice))
        return 0

    monkeypatch.setattr(_bigbuf, "_madvise", recording_madvise)
    monkeypatch.setattr(_bigbuf, "_cpus", lambda: 4)
    address, length = 4096 * 1000 + 123, 8 * POPULATE_MIN + 5
    futures = populate(address, length)
    concurrent.futures.wait(futures)
    assert [f.result() for f in futures] == [0] * len(futures)
    assert {advice for _, _, advice in calls} == {_bigbuf._MADV_POPULATE_WRITE}
    spans = sorted((a, a + n) for a, n, _ in calls)
    assert len(spans) == 3  # four shares; the first is left to the writer, who starts there
    start = (address + 4095) // 4096 * 4096
    share = spans[0][1] - spans[0][0]
    assert share % (2 << 20) == 0
    assert spans[0][0] == start + share
    assert all(a == b for (_, b), (a, _) in itertools.pairwise(spans))  # contiguous, no overlap
    assert spans[-1][1] == (address + length) // 4096 * 4096  # up to the last whole small page
    assert all(a % 4096 == 0 and b % 4096 == 0 for a, b in spans)
    assert populate(address, POPULATE_MIN - 1) == []
    monkeypatch.setattr(_bigbuf, "_cpus", lambda: 1)
    assert populate(address, length) == []


@pytest.mark.skipif(_bigbuf._madvise is None, reason="madvise is Linux's")
def test_pickle_populate_on_real_memory_keeps_its_bytes() -> None:
    buf = bytearray(POPULATE_MIN + HUGE_MIN)
    buf[::4096] = b"\x07" * len(buf[::4096])
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    futures = populate(address, len(buf))
    concurrent.futures.wait(futures, timeout=60)
    assert all(f.result() in (0, -1) for f in futures)  # -1: a kernel without MADV_POPULATE_WRITE
    assert buf[::4096] == b"\x07" * len(buf[::4096])
    assert buf.count(0) == len(buf) - len(buf[::4096])
