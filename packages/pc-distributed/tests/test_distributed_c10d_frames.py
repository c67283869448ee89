"""The c10d transport's receive buffers and links, without other processes."""

from __future__ import annotations

import gc
import random
import struct
import threading
from typing import Any

import pytest
import torch

from pc_distributed import _torch_dist
from pc_distributed.rpc import _c10d_frames as frames
from pc_distributed.rpc._c10d_codec import Encoded, decode, encode
from pc_distributed.rpc._c10d_frames import (
    PACK_ALIGN,
    PACK_MAX,
    Buffers,
    HeaderReceive,
    Incoming,
    _body,
    packs,
    post_frame,
    receive_parts,
)


def test_buffers_of_different_sizes_are_reused_whatever_their_order() -> None:
    buffers = Buffers(keep_bytes=8 << 20, min_bytes=1 << 10)
    first, second = buffers.take(400_807), buffers.take(400_770)
    addresses = {first.data_ptr(), second.data_ptr()}
    buffers.give(first)
    buffers.give(second)
    # the best fit is not the first free block
    again = buffers.take(400_770)
    assert again.numel() == 400_770
    assert again.data_ptr() in addresses
    other = buffers.take(400_800)
    assert other.data_ptr() in addresses - {again.data_ptr()}
    assert buffers.take(400_000).data_ptr() not in addresses  # both lent: a new one


def test_buffers_keep_at_most_their_budget_and_ignore_what_they_did_not_lend() -> None:
    buffers = Buffers(keep_bytes=3 << 20, min_bytes=1 << 10)
    lent = [buffers.take(1 << 20) for _ in range(4)]
    for payload in lent:
        payload.fill_(7)  # fresh memory reads zero: what reads 7 later was kept
    buffers.give(torch.empty(1 << 20, dtype=torch.uint8))  # not theirs: ignored
    for payload in lent:
        buffers.give(payload)
    again = [buffers.take(1 << 20) for _ in range(4)]
    assert sorted(int(t[0]) for t in again) == [0, 7, 7, 7]  # three kept, the fourth dropped
    small = buffers.take(100)  # under min_bytes: never kept
    buffers.give(small)
    assert buffers.take(100).numel() == 100


def test_lent_memory_comes_back_once_the_last_tensor_on_it_is_freed_not_before() -> None:
    buffers = Buffers(keep_bytes=8 << 20, min_bytes=1 << 10)
    part = buffers.lend(1 << 20)
    address = part.data_ptr()
    # what the codec does with a part: tensors of other types over its storage, at offsets
    floats = torch.empty(0).set_(part.untyped_storage(), 1024, (1000,))
    view = floats[10:20]
    del part, floats
    gc.collect()
    assert buffers.idle_bytes() == 0  # a view still uses it
    other = buffers.lend(1 << 20)
    assert other.data_ptr() != address
    view.fill_(3.0)
    del view
    assert buffers.idle_bytes() == 1 << 20  # back without a garbage collection: reference counting
    again = buffers.lend((1 << 20) - 100)  # fits: at most twice its size
    assert again.data_ptr() == address
    assert float(again.view(torch.float32)[1034]) == 3.0  # the same memory, as it was left
    third = buffers.lend(1 << 20)
    assert third.data_ptr() not in (address, other.data_ptr())
    small = buffers.lend(100)  # under min_bytes: torch's own memory, never kept
    del small
    assert buffers.idle_bytes() == 0


def test_lent_and_taken_memory_share_one_budget() -> None:
    buffers = Buffers(keep_bytes=3 << 20, min_bytes=1 << 10)
    lent = [buffers.lend(1 << 20) for _ in range(2)]
    taken = [buffers.take(1 << 20) for _ in range(2)]
    for tensor in lent + taken:
        tensor.fill_(7)  # fresh memory reads zero: what reads 7 later was reused
    del lent, tensor
    for body in taken:
        buffers.give(body)
    assert buffers.idle_bytes() == 3 << 20  # four came back, three kept
    reused = [buffers.take(1 << 20), *(buffers.lend(1 << 20) for _ in range(3))]
    assert sorted(int(t[0]) for t in reused) == [0, 7, 7, 7]


def test_memory_freed_inside_the_buffers_is_sorted_in_later_and_closed_buffers_keep_nothing() -> None:
    buffers = Buffers(keep_bytes=8 << 20, min_bytes=1 << 10)
    part = buffers.lend(1 << 20)
    with buffers._lock:  # as when the garbage collector frees a tensor while this thread is inside them
        del part  # must neither deadlock nor change the idle list under the lock's holder
        assert buffers._free == []
    assert buffers.idle_bytes() == 1 << 20
    held = buffers.lend(2 << 20)
    buffers.close()
    assert buffers.idle_bytes() == 0
    del held
    assert buffers.idle_bytes() == 0  # unmapped as it came back
    assert buffers.lend(1 << 20).numel() == 1 << 20  # still lends


def test_a_body_comes_back_once_whether_given_back_or_only_freed() -> None:
    buffers = Buffers(keep_bytes=8 << 20, min_bytes=1 << 10)
    given = buffers.take(1 << 20)
    buffers.give(given)
    buffers.give(given)  # twice: ignored
    assert buffers.idle_bytes() == 1 << 20
    del given  # its block came back already: not a second time
    assert buffers.idle_bytes() == 1 << 20
    first, second = buffers.take(1 << 20), buffers.take(1 << 20)
    assert first.data_ptr() != second.data_ptr()
    assert buffers.idle_bytes() == 0
    del first  # never given back (a reply to a call that timed out): it comes back once freed
    assert buffers.idle_bytes() == 1 << 20
    assert len(buffers._taken) == 1  # and is forgotten; the other is still out
    buffers.give(second)
    del second
    assert buffers.idle_bytes() == 2 << 20
    assert buffers._taken == {}


def test_memory_lent_and_freed_by_many_threads_is_never_lent_twice() -> None:
    buffers = Buffers(keep_bytes=4 << 20, min_bytes=1 << 10)
    failures: list[str] = []
    live: dict[int, int] = {}  # address -> owning thread, of every lent tensor still alive
    lock = threading.Lock()

    def churn(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[torch.Tensor] = []
        for _ in range(300):
            if mine and (len(mine) > 4 or rng.random() < 0.5):
                tensor = mine.pop(rng.randrange(len(mine)))
                if not bool((tensor == (seed * 7 + tensor.numel()) % 251).all()):
                    failures.append(f"thread {seed}: a lent tensor was written by someone else")
                with lock:
                    del live[tensor.data_ptr()]
                del tensor  # its memory goes back here, on this thread, while others lend
            else:
                tensor = buffers.lend(rng.choice((4 << 10, 64 << 10, 300 << 10)))
                with lock:
                    if tensor.data_ptr() in live:
                        failures.append(f"thread {seed}: memory lent while still in use")
                    live[tensor.data_ptr()] = seed
                tensor.fill_((seed * 7 + tensor.numel()) % 251)
                mine.append(tensor)
        with lock:  # what this thread still holds is freed as it ends
            for tensor in mine:
                del live[tensor.data_ptr()]

    threads = [threading.Thread(target=churn, args=(s,)) for s in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads)
    assert failures == []
    assert 0 < buffers.idle_bytes() <= 4 << 20


def test_a_link_is_a_two_member_gloo_group_and_needs_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    store = _torch_dist.master_store("127.0.0.1", 0, 1, 10)
    # the peer never arrives: gloo's own rendezvous gives up after the link's timeout
    with pytest.raises(RuntimeError):
        _torch_dist.pair_link(store, 0, 1, 0.5)
    monkeypatch.setattr(_torch_dist, "_ProcessGroupGloo", None)
    with pytest.raises(RuntimeError, match="no gloo"):
        _torch_dist.pair_link(store, 0, 1, 0.5)


def test_links_share_a_device_only_where_gloo_has_group_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    devices = _torch_dist.link_devices()  # every torch supported has the options (private, so checked)
    assert devices is not None
    assert len(devices) == 1

    class Renamed:  # a torch whose options lost a field
        _devices = None

    monkeypatch.setattr(_torch_dist, "_GLOO_OPTIONS", Renamed)
    assert _torch_dist.link_devices() is None
    monkeypatch.setattr(_torch_dist, "_GLOO_OPTIONS", None)
    assert _torch_dist.link_devices() is None


def test_shared_devices_follow_gloo_socket_ifname_as_torchs_own_groups_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[tuple[str, str]] = []

    class Gloo:  # records which devices would be made
        _Options = _torch_dist._GLOO_OPTIONS

        @staticmethod
        def create_device(interface: str = "") -> str:
            made.append(("interface", interface))
            return interface

        @staticmethod
        def create_default_device() -> str:
            made.append(("default", ""))
            return "default"

    monkeypatch.setattr(_torch_dist, "_ProcessGroupGloo", Gloo)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1,eth2")
    assert _torch_dist.link_devices() == ["eth1", "eth2"]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")
    assert _torch_dist.link_devices() == ["default"]
    assert made == [("interface", "eth1"), ("interface", "eth2"), ("default", "")]


class _Delivering:
    """A link that delivers each posted receive at once from a queue of payloads (no other process)."""

    def __init__(self, payloads: list[torch.Tensor]) -> None:
        self.payloads = payloads
        self.received: list[torch.Tensor] = []

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        tensors[0].copy_(self.payloads.pop(0))
        self.received.append(tensors[0])
        return self

    def wait(self) -> bool:
        return True


def test_parts_of_device_storages_are_marked_and_received_pinned_where_cuda_is() -> None:
    plain, staged = torch.arange(16, dtype=torch.uint8), torch.full((8,), 7, dtype=torch.uint8)
    message = Encoded(b"Rhead", (plain, staged), frozenset({1}))
    body = torch.frombuffer(bytearray(_body(message)), dtype=torch.uint8)
    link = _Delivering([plain, staged])
    incoming = receive_parts(link, 0, body, 2, Buffers(min_bytes=8))
    assert isinstance(incoming, Incoming)
    expected = [plain.tolist(), staged.tolist()]  # received at their sizes, the mark taken off
    assert [p.tolist() for p in incoming.parts] == expected
    assert bytes(incoming.head()) == b"Rhead"
    assert [p.is_pinned() for p in incoming.parts] == [False, torch.cuda.is_available()]


def test_size_words_that_are_not_sizes_are_described_not_received() -> None:
    for word in (0, -5, 1 << 62):  # empty, negative, and the device mark on an empty part
        body = torch.frombuffer(bytearray(struct.pack("<q", word) + b"R"), dtype=torch.uint8)
        link = _Delivering([])
        assert receive_parts(link, 0, body, 1, Buffers()) == f"not sizes of message parts: [{word}]"
        assert link.received == []


# -- packs: small parts share a message ------------------------------------------------------------------


def test_small_parts_share_messages_and_large_or_staged_parts_go_alone() -> None:
    kb = 100_000
    staged = frames._STAGED
    assert packs([kb] * 4) == [[0, 1, 2, 3]]
    assert packs([2 << 20, kb, kb, PACK_MAX, kb]) == [[0], [1, 2], [3], [4]]
    assert packs([kb, kb | staged, kb]) == [[0], [1], [2]]  # a staged part is received pinned, alone
    assert packs([600_000, 600_000, 600_000]) == [[0], [1], [2]]  # a pack stays within PACK_MAX
    # a part starts at an aligned offset: it fits exactly, or one byte more does not
    half = PACK_MAX // 2
    assert packs([half - 1, half]) == [[0, 1]]
    assert packs([half + 1, half - PACK_ALIGN]) == [[0, 1]]
    assert packs([half + 1, half - PACK_ALIGN + 1]) == [[0], [1]]
    assert packs([]) == []


class _Recording:
    """A link that records what each posted send carries (as it is when posted: packs are copies)."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, torch.Tensor]] = []

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        self.sent.append((tag, tensors[0].clone()))
        return self

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:  # pragma: no cover - not used
        raise AssertionError("a recording link only sends")

    def wait(self) -> bool:
        return True


def _across(value: Any, buffers: Buffers) -> tuple[Any, int, Incoming]:
    """``value`` posted as a frame and received again: (what arrives, payload messages sent, the message)."""
    link = _Recording()
    message = encode(value, "a test value")
    post_frame(link, 1, frames.CALL, 0, 7, 0, message).wait()
    (tag, header), *payloads = link.sent
    assert tag == frames.HEADER_TAG
    assert all(t == frames.PAYLOAD_TAG for t, _ in payloads)
    received = HeaderReceive(header, link).take()
    assert isinstance(received, frames.Header)
    assert received.inline is not None
    incoming = receive_parts(
        _Delivering([p for _, p in payloads]), 0, received.inline, received.nparts, buffers
    )
    assert isinstance(incoming, Incoming)
    return decode(incoming.head(), incoming.parts), len(payloads), incoming


def test_a_frame_of_packed_and_lone_parts_arrives_whole_each_part_with_a_storage_of_its_own() -> None:
    torch.manual_seed(0)
    shared = torch.randn(30_000, dtype=torch.float64)
    value = {
        "odd floats": torch.randn(25_001),  # 100,004 bytes: the next part starts at an aligned offset
        "ints": torch.arange(40_000, dtype=torch.int64),
        "large": torch.randn(300_000, dtype=torch.float64),  # 2.4 MB: alone, not copied
        "bytes": torch.randint(0, 255, (70_001,), dtype=torch.uint8),
        "view": shared[5:29_000],  # a view of most of its storage: the storage travels, the view is rebuilt
        "again": shared,
        "small": torch.ones(10),  # rides inside the pickle
    }
    buffers = Buffers(min_bytes=1 << 10)
    got, messages, incoming = _across(value, buffers)
    assert messages == 3  # one pack of the four small parts, then the large part alone, then the last pack
    assert [p.numel() for p in incoming.parts] == [100_004, 320_000, 2_400_000, 70_001, 240_000]
    for name, tensor in value.items():
        assert torch.equal(got[name], tensor), name
        assert got[name].dtype == tensor.dtype
    assert got["view"].untyped_storage().data_ptr() == got["again"].untyped_storage().data_ptr()
    for part in incoming.parts:
        assert part.untyped_storage().nbytes() == part.numel()  # exactly its own bytes, as if alone
        assert part.data_ptr() % PACK_ALIGN == 0


def test_a_pack_comes_back_once_every_part_received_in_it_is_freed() -> None:
    buffers = Buffers(keep_bytes=8 << 20, min_bytes=1 << 10)
    got, messages, incoming = _across([torch.full((25_000,), float(i)) for i in range(4)], buffers)
    assert messages == 1
    assert [float(t[0]) for t in got] == [0.0, 1.0, 2.0, 3.0]
    del incoming
    kept = got[2]
    del got
    gc.collect()
    assert buffers.idle_bytes() == 0  # one part of the pack still lives
    kept.fill_(9.0)  # and its memory is still its own
    del kept
    assert buffers.idle_bytes() >= 400_000  # back without a garbage collection
    again, _, _ = _across([torch.full((25_000,), -1.0) for _ in range(4)], buffers)
    assert buffers.idle_bytes() == 0  # received into the same block
    assert [float(t.min()) for t in again] == [-1.0] * 4


def test_pieces_must_lie_within_what_is_lent() -> None:
    buffers = Buffers(min_bytes=1 << 10)
    whole, pieces = buffers.lend_pieces(4096, [(0, 100), (128, 3968)])
    assert whole.numel() == 4096
    assert [p.numel() for p in pieces] == [100, 3968]
    pieces[1].fill_(5)
    assert int(whole[128]) == 5
    assert int(whole[4095]) == 5
    for bad in ((4000, 100), (-1, 10), (0, -1)):
        with pytest.raises(ValueError, match="does not lie within 4096 bytes"):
            buffers.lend_pieces(4096, [bad])
    small_whole, small = buffers.lend_pieces(100, [(0, 10), (64, 36)])  # under min_bytes: not kept
    assert [p.numel() for p in small] == [10, 36]
    assert small_whole.numel() == 100
