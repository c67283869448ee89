"""The c10d transport's receive buffers and links, without other processes."""

from __future__ import annotations

import ctypes
import gc
import random
import struct
import threading
from typing import Any

import pytest
import torch

from pc_distributed import _store, _torch_dist
from pc_distributed.rpc._c10d import frames
from pc_distributed.rpc._c10d.codec import Encoded, decode, encode
from pc_distributed.rpc._c10d.frames import (
    PACK_ALIGN,
    PACK_MAX,
    PREDICT_MAX,
    HeaderReceive,
    Incoming,
    _body,
    packs,
    post_frame,
    predicts,
    receive_parts,
)
from pc_distributed.rpc._c10d.memory import Buffers, bytes_tensor, host_view


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


def test_host_views_show_the_memory_itself_and_keep_it_alive() -> None:
    floats = torch.arange(6, dtype=torch.float32)
    view = host_view(floats)
    assert view.nbytes == 24
    assert bytes(view) == floats.numpy().tobytes()
    floats[0] = 42.0  # a view, not a copy
    assert struct.unpack_from("<f", view)[0] == 42.0
    storage = torch.arange(100, dtype=torch.uint8)[10:20].untyped_storage()  # the whole storage, not the view
    assert host_view(storage).nbytes == 100
    assert host_view(torch.empty(0)).nbytes == 0
    given = memoryview(bytearray(b"abc"))
    assert host_view(given) is given
    # the view alone keeps the tensor's memory: freed tensor, intact bytes
    kept = host_view(torch.full((1 << 16,), 7, dtype=torch.uint8))
    gc.collect()
    _ = [torch.zeros(1 << 16, dtype=torch.uint8) for _ in range(8)]  # what would reuse freed memory
    assert set(bytes(kept)) == {7}


def test_bytes_tensors_are_the_bytes_themselves_and_keep_them_alive() -> None:
    data = bytes(range(256)) * 4
    tensor = bytes_tensor(data)
    assert tensor.dtype == torch.uint8
    assert tensor.tolist() == list(data)
    assert tensor.data_ptr() == ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value  # not a copy
    assert bytes_tensor(b"").numel() == 0
    # the tensor alone keeps the bytes: dropped bytes, intact values
    kept = bytes_tensor(b"\x07" * (1 << 16))
    gc.collect()
    _ = [bytes(1 << 16) for _ in range(8)]  # what would reuse freed memory
    assert set(kept.tolist()) == {7}


def test_a_link_is_a_two_member_gloo_group_and_needs_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store.master_store("127.0.0.1", 0, 1, 10)
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
    link = _Delivering([plain, staged, torch.zeros(16, dtype=torch.uint8)])
    incoming, ahead = receive_parts(link, 0, body, 2, Buffers(min_bytes=8))
    assert ahead is not None  # the first message (the plain part) is posted ahead for the next frame
    assert ahead.nbytes == plain.numel()
    assert isinstance(incoming, Incoming)
    expected = [plain.tolist(), staged.tolist()]  # received at their sizes, the mark taken off
    assert [p.tolist() for p in incoming.parts] == expected
    assert bytes(incoming.head()) == b"Rhead"
    assert [p.is_pinned() for p in incoming.parts] == [False, torch.cuda.is_available()]


def test_size_words_that_are_not_sizes_are_described_not_received() -> None:
    for word in (0, -5, 1 << 62):  # empty, negative, and the device mark on an empty part
        body = torch.frombuffer(bytearray(struct.pack("<q", word) + b"R"), dtype=torch.uint8)
        link = _Delivering([])
        described, _ = receive_parts(link, 0, body, 1, Buffers())
        assert described == f"not sizes of message parts: [{word}]"
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


class _Loopback:
    """Both ends of a link in one process: a send queues its bytes (as they are when posted: packs are
    copies) under its tag, and receives take them in the order they were posted under the same tag, as gloo
    matches them. Every receive must have the exact size of the message it takes."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, torch.Tensor]] = []  # (tag, bytes) of every send, in order
        self._queued: dict[int, list[torch.Tensor]] = {}
        self._receives: dict[int, list[_Receive]] = {}

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        self.sent.append((tag, tensors[0].clone()))
        self._queued.setdefault(tag, []).append(self.sent[-1][1])
        return _Receive(self, tag, None)  # a send is done once posted

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        receive = _Receive(self, tag, tensors[0])
        self._receives.setdefault(tag, []).append(receive)
        return receive

    def match(self, tag: int, until: _Receive) -> None:
        """Complete the receives posted under ``tag`` up to ``until``, in order, from the queued sends."""
        while until.tensor is not None:
            first = self._receives[tag].pop(0)
            data = self._queued[tag].pop(0)  # IndexError: a receive waited for with nothing sent to it
            assert first.tensor is not None
            assert first.tensor.numel() == data.numel(), "a receive not of the exact size of its message"
            first.tensor.copy_(data)
            first.tensor = None


class _Receive:
    def __init__(self, link: _Loopback, tag: int, tensor: torch.Tensor | None) -> None:
        self.link, self.tag, self.tensor = link, tag, tensor

    def wait(self) -> bool:
        self.link.match(self.tag, self)
        return True


class _Ends:
    """A sender and a receiver of frames over a :class:`_Loopback`, with what each knows of the other."""

    def __init__(self, buffers: Buffers) -> None:
        self.link = _Loopback()
        self.buffers = buffers
        self.predicted: int | None = None  # the sender's view: the size the receiver posted ahead
        self.prediction: frames.Prediction | None = None  # the receiver's receive posted ahead

    def across(self, value: Any) -> tuple[Any, list[int], Incoming]:
        """``value`` posted as a frame and received: what arrives, the payloads' tags, the message."""
        message = encode(value, "a test value")
        before = len(self.link.sent)
        posted = post_frame(self.link, 1, frames.CALL, 0, 7, 0, message, predicted=self.predicted)
        posted.wait()
        self.predicted = posted.predicted
        (tag, header), *payloads = self.link.sent[before:]
        assert tag == frames.HEADER_TAG
        self.link._queued[tag].pop(0)  # taken here, as the posted header receive would
        data = bytearray(header.numpy().tobytes())  # the receiving end's header memory
        received = HeaderReceive(
            torch.frombuffer(data, dtype=torch.uint8), data, _Receive(self.link, tag, None)
        ).take()
        assert isinstance(received, frames.Header)
        assert received.inline is not None
        incoming, self.prediction = receive_parts(
            self.link, 0, received.inline, received.nparts, self.buffers, self.prediction, received.predicted
        )
        assert isinstance(incoming, Incoming)
        assert (self.predicted is None) == (self.prediction is None)
        assert self.prediction is None or self.prediction.nbytes == self.predicted  # both ends agree
        return decode(incoming.head(), incoming.parts), [t for t, _ in payloads], incoming


def _across(value: Any, buffers: Buffers) -> tuple[Any, int, Incoming]:
    """``value`` as a first frame: (what arrives, how many payload messages it took, the message)."""
    got, tags, incoming = _Ends(buffers).across(value)
    assert set(tags) <= {frames.PAYLOAD_TAG}  # nothing is posted ahead before a first frame
    return got, len(tags), incoming


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
    ends = _Ends(buffers)
    got, tags, incoming = ends.across([torch.full((25_000,), float(i)) for i in range(4)])
    assert tags == [frames.PAYLOAD_TAG]  # one message for the four parts
    assert [float(t[0]) for t in got] == [0.0, 1.0, 2.0, 3.0]
    del incoming
    kept = got[2]
    del got
    gc.collect()
    assert buffers.idle_bytes() == 0  # one part of the pack still lives (and a receive waits, posted ahead)
    kept.fill_(9.0)  # and its memory is still its own
    del kept
    assert buffers.idle_bytes() >= 400_000  # back without a garbage collection
    again, tags, _ = ends.across([torch.full((25_000,), -1.0) for _ in range(4)])
    assert tags == [frames.PREDICTED_TAG]
    assert buffers.idle_bytes() == 0  # the next receive posted ahead took the block that came back
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


# -- receives posted ahead ---------------------------------------------------------------------------------


def test_the_size_posted_ahead_is_the_last_one_that_could_be_when_none_other_waited() -> None:
    kb, staged = 100_000, frames._STAGED
    span4 = frames._offsets([kb] * 4)[1]
    assert predicts([kb] * 4, None) == (False, span4)  # a first frame: posted ahead for the next one
    assert predicts([kb] * 4, span4) == (True, span4)  # the same sizes: sent there, and posted again
    assert predicts([kb] * 2, span4) == (False, span4)  # others: sent as before; the waiting one stays
    assert predicts([], span4) == (False, span4)  # no parts
    assert predicts([kb | staged, kb], span4) == (False, span4)  # a staged first part goes pinned
    assert predicts([kb | staged], None) == (False, None)
    too_big = PREDICT_MAX + 1
    assert predicts([too_big], None) == (False, None)  # would hold too much memory waiting
    assert predicts([PREDICT_MAX], None) == (False, PREDICT_MAX)
    assert predicts([2 << 20, kb], None) == (False, 2 << 20)  # the first message is the large part alone


def test_a_frame_that_repeats_its_sizes_sends_its_first_message_to_the_receive_posted_ahead() -> None:
    buffers = Buffers(keep_bytes=64 << 20, min_bytes=1 << 10)
    ends = _Ends(buffers)
    four = [torch.full((25_000,), float(i)) for i in range(4)]
    payload, ahead = frames.PAYLOAD_TAG, frames.PREDICTED_TAG
    frames_sent = [
        (four, [payload]),  # a first frame: its receives are posted once its header came
        (four, [ahead]),  # the same sizes: straight to the receive posted ahead
        ([four[0], four[1]], [payload]),  # other sizes: as before (the receive posted ahead still waits)
        ({"big": torch.ones(1 << 20), "small": four}, [payload, payload]),  # a large first part: as before
        ([t + 1 for t in four], [ahead]),  # the first sizes again: the receive still waiting takes them
        ([t + 2 for t in four], [ahead]),
        ("no parts", []),
        ([t + 3 for t in four], [ahead]),
    ]
    for value, tags in frames_sent:
        got, sent_tags, incoming = ends.across(value)
        assert sent_tags == tags
        if isinstance(value, list):
            assert [float(t[0]) for t in got] == [float(t[0]) for t in value]
            assert all(torch.equal(a, b) for a, b in zip(got, value, strict=True))
        elif isinstance(value, dict):
            assert torch.equal(got["big"], value["big"])
        for part in incoming.parts:
            assert part.untyped_storage().nbytes() == part.numel()
    # a frame received into the receive posted ahead keeps its memory until freed; one more receive waits
    assert ends.prediction is not None
    held = ends.prediction.nbytes
    del got, incoming
    assert buffers.idle_bytes() >= 3 * 400_000  # what arrived came back once freed...
    assert ends.prediction.nbytes == held  # ...but not the receive that waits


def test_a_header_that_does_not_match_the_receive_posted_ahead_is_described_not_received() -> None:
    kb = 100_000
    body = torch.frombuffer(bytearray(struct.pack("<2q", kb, kb) + b"R"), dtype=torch.uint8)
    link = _Loopback()
    described, ahead = receive_parts(link, 0, body, 2, Buffers(), None, True)  # none was posted ahead
    assert isinstance(described, str)
    assert "do not match the receive posted ahead" in described
    assert ahead is None
    waiting = frames.post_prediction(link, 0, 12_345, Buffers())
    described, ahead = receive_parts(link, 0, body, 2, Buffers(), waiting, True)  # posted for other sizes
    assert isinstance(described, str)
    assert ahead is waiting
    assert link.sent == []  # nothing was taken
