"""The fast path: the cached reducer_override, and the loader's reader.

The reader hands out views of the payload (no copies), and its windows end where raw regions begin.
"""

from __future__ import annotations

import pickle
import struct

import pytest
import torch

import pc_pickle
from pc_pickle import _payload, _seal, _tensors
from pc_pickle._bigbuf import HUGE_MIN
from pc_pickle._errors import PayloadError

pytestmark = pytest.mark.filterwarnings("error")


def _region_starts(data: bytes) -> list[int]:
    """Where the header's raw regions begin, read independently of _seal (layout in its docstring)."""
    (head_size,) = struct.unpack_from("<I", data, 3)
    count = struct.unpack_from("<I", data, 7 + 4 + 2 + 8 + 4)[0]
    body = 7 + head_size + 1
    return [body + struct.unpack_from("<QQ", data, 7 + 22 + 16 * i)[0] for i in range(count)]


def _payload_with_regions() -> tuple[bytes, dict[str, torch.Tensor]]:
    obj = {
        "a": torch.arange(HUGE_MIN // 4, dtype=torch.float32),  # advised: a huge-page destination
        "small": torch.ones(3),
        "b": torch.linspace(0, 1, 40_000),  # 160 KB: a region, not advised
        "c": torch.arange(HUGE_MIN // 8, dtype=torch.float64),
    }
    return pc_pickle.dumps(obj), obj


def test_pickle_verify_returns_the_region_starts() -> None:
    data, _ = _payload_with_regions()
    starts = _seal.verify(memoryview(data))
    assert list(starts) == _region_starts(data)
    assert len(starts) == 3


def test_pickle_reader_windows_are_views_that_stop_at_regions() -> None:
    data = bytes(range(256)) * 40
    view = memoryview(data)
    reader = _payload._Reader(view, (1000, 5000))
    window = reader.peek(10)
    assert isinstance(window, memoryview)
    assert window.obj is data  # a view of the payload, not a copy
    assert len(window) == 1000  # the whole stream up to the first region, whatever size was asked
    first = reader.read(1000)
    assert isinstance(first, memoryview)
    assert first.obj is data
    assert bytes(first) == data[:1000]
    assert len(reader.peek(1)) == 4000  # from a region start to the next one
    reader.read(4500)
    assert bytes(reader.peek(1)) == data[5500:]  # past the last region: the rest
    target = bytearray(100)
    assert reader.readinto(target) == 100
    assert target == data[5500:5600]
    assert bytes(reader.read()) == data[5600:]
    assert reader.read(1) == b""
    assert reader.peek(1) == b""


def test_pickle_reader_lends_regions_instead_of_copying_them() -> None:
    """With lent regions, readinto at a region start leaves its target untouched and lends a payload view."""
    data = bytes(range(256)) * 40
    regions = _tensors.LentRegions()
    reader = _payload._Reader(memoryview(data), (1000, 5000), regions)
    reader.read(1000)
    target = bytearray(4000)
    assert reader.readinto(target) == 4000
    assert target == bytes(4000)  # not written
    lent = regions.take(target)
    assert lent is not None
    assert lent.obj is data
    assert bytes(lent) == data[1000:5000]
    assert regions.take(target) is None  # taken once
    assert len(regions) == 0
    reader.read(10)
    elsewhere = bytearray(100)  # not at a region start: copied as before
    assert reader.readinto(elsewhere) == 100
    assert elsewhere == data[5010:5110]
    assert len(regions) == 0


def test_pickle_lent_region_of_the_wrong_size_is_refused() -> None:
    regions = _tensors.LentRegions()
    target = bytearray(10)
    regions.lend(memoryview(target), memoryview(b"x" * 9))
    with pytest.raises(PayloadError, match="raw region of 9 bytes"):
        regions.take(target)


def test_pickle_reader_readline() -> None:
    reader = _payload._Reader(memoryview(b"ab\ncd"))
    assert reader.readline() == b"ab\n"
    assert reader.readline() == b"cd"
    assert reader.readline() == b""


def test_pickle_raw_regions_are_read_into_their_destination(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every region reaches readinto instead of being copied out of a window, then is copied whole into its
    (huge-page advised) storage when its table entry is built: once, not through a window."""
    data, obj = _payload_with_regions()
    seen: list[int] = []
    monkeypatch.setattr(_payload, "_advise_target", lambda target: seen.append(len(target)))
    monkeypatch.setattr(_tensors, "advise", lambda address, length: seen.append(length))
    for kind in (bytes, bytearray, memoryview):
        seen.clear()
        out = pc_pickle.loads(kind(data))
        assert sorted(seen) == sorted(t.untyped_storage().nbytes() for k, t in obj.items() if k != "small")
        for key, tensor in obj.items():
            assert torch.equal(out[key], tensor)


def test_pickle_plain_pickle_loads_still_reads_a_payload() -> None:
    data, obj = _payload_with_regions()
    out = pickle.loads(data)
    assert all(torch.equal(out[k], t) for k, t in obj.items())


class _Item:
    def __init__(self, i: int) -> None:
        self.i = i


def test_pickle_reducer_is_chosen_once_per_type(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook caches its choice by exact type: each type is chosen once per dump, and the choice holds."""
    from pc_pickle import _pickler

    chosen: list[type] = []
    original = _pickler._choose

    def counting(cls: type, **kwargs: object) -> object:
        chosen.append(cls)
        return original(cls, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_pickler, "_choose", counting)
    weight = torch.arange(4.0)
    obj = [_Item(i) for i in range(100)] + [weight[i:] for i in range(4)] + [len] * 96
    out = pc_pickle.loads(pc_pickle.dumps(obj))
    assert len(chosen) == len(set(chosen))  # once per type (the classes and rebuild functions count too)
    assert {_Item, torch.Tensor, type(len)} <= set(chosen)
    assert [x.i for x in out[:100]] == list(range(100))
    assert out[103].untyped_storage().data_ptr() == out[100].untyped_storage().data_ptr()  # table, not torch
    assert out[104] is len


def _outer_as_one_object(graph: list[bytes | bytearray]) -> bytes:
    chunks = _payload.Chunks()
    pickle.Pickler(chunks, protocol=5).dump(_payload.Payload([], b"".join(graph)))
    return b"".join(chunks.parts)


@pytest.mark.parametrize(
    ("graph", "spliced"),
    [
        ([bytes(range(256)) * 300, b"tail"], True),  # 76 KB: the pieces replace the stand-in
        ([b"x" * (64 * 1024)], True),  # exactly the size the pickler writes straight to the file
        ([b"x" * (64 * 1024 - 1)], False),  # one byte less: copied into the frame, so joined first
        ([bytes(70_000), bytearray(b"mutable")], False),  # not all bytes: joined
    ],
)
def test_pickle_outer_pieces_equal_the_outer_pickle_of_the_joined_graph(
    graph: list[bytes | bytearray], spliced: bool
) -> None:
    pieces = _payload.outer_pieces([], list(graph))
    assert b"".join(pieces) == _outer_as_one_object(graph)  # the same stream, byte for byte
    assert any(piece is graph[0] for piece in pieces) is spliced  # spliced: the graph's own objects, no copy


def test_pickle_a_spliced_graph_round_trips() -> None:
    obj = [_Item(i) if i % 2 else {"id": i, "v": (i, 0.5), "s": f"n{i}"} for i in range(5_000)]
    data = pc_pickle.dumps(obj)
    assert len(data) > 64 * 1024
    out = pc_pickle.loads(data)
    assert [x.i if isinstance(x, _Item) else x for x in out] == [
        x.i if isinstance(x, _Item) else x for x in obj
    ]
