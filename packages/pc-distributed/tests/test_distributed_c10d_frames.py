"""The c10d transport's frames: the receive buffers it reuses for large payloads (no processes needed)."""

from __future__ import annotations

import torch

from pc_distributed.rpc._c10d_frames import Buffers


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
