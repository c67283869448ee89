"""The c10d transport's receive buffers and links, without other processes."""

from __future__ import annotations

import struct
from typing import Any

import pytest
import torch

from pc_distributed import _torch_dist
from pc_distributed.rpc._c10d_codec import Encoded
from pc_distributed.rpc._c10d_frames import Buffers, Incoming, _body, receive_parts


def test_buffers_of_different_sizes_are_reused_whatever_their_order() -> None:
    buffers = Buffers(keep_bytes=8 << 20, min_bytes=1 << 10)
    first, second = buffers.take(400_807), buffers.take(400_770)
    addresses = {first.data_ptr(), second.data_ptr()}
    buffers.give(first)
    buffers.give(second)
    # the best fit is not the first free buffer: picking it must not compare tensors element by element
    again = buffers.take(400_770)
    assert again.numel() == 400_770
    assert again.data_ptr() in addresses
    other = buffers.take(400_800)
    assert other.data_ptr() in addresses - {again.data_ptr()}
    assert buffers.take(400_000).data_ptr() not in addresses  # both lent: a new one


def test_buffers_keep_at_most_their_budget_and_ignore_what_they_did_not_lend() -> None:
    buffers = Buffers(keep_bytes=3 << 20, min_bytes=1 << 10)
    lent = [buffers.take(1 << 20) for _ in range(4)]
    buffers.give(torch.empty(1 << 20, dtype=torch.uint8))  # not theirs: ignored
    for payload in lent:
        buffers.give(payload)
    reused = {buffers.take(1 << 20).data_ptr() for _ in range(4)}
    assert len(reused & {p.data_ptr() for p in lent}) == 3  # three kept, the fourth dropped
    small = buffers.take(100)  # under min_bytes: never kept
    buffers.give(small)
    assert buffers.take(100).numel() == 100


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
    incoming = receive_parts(link, 0, body, 2)
    assert isinstance(incoming, Incoming)
    expected = [plain.tolist(), staged.tolist()]  # received at their sizes, the mark taken off
    assert [p.tolist() for p in incoming.parts] == expected
    assert bytes(incoming.head()) == b"Rhead"
    assert [p.is_pinned() for p in incoming.parts] == [False, torch.cuda.is_available()]


def test_size_words_that_are_not_sizes_are_described_not_received() -> None:
    for word in (0, -5, 1 << 62):  # empty, negative, and the device mark on an empty part
        body = torch.frombuffer(bytearray(struct.pack("<q", word) + b"R"), dtype=torch.uint8)
        link = _Delivering([])
        assert receive_parts(link, 0, body, 1) == f"not sizes of message parts: [{word}]"
        assert link.received == []
