"""The copy path's large buffers: the huge-page join equals ``b"".join``; big tensors load from any input."""

from __future__ import annotations

import pickle

import pytest
import torch

import pc_pickle
from pc_pickle._bigbuf import HUGE_MIN, join


@pytest.mark.parametrize("total", [0, 10, HUGE_MIN - 1, HUGE_MIN, 3 * HUGE_MIN + 12345])
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
