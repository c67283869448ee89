"""The exchange packet between processes and its checks, without processes (``pc_sync._exchange``).

The packets of a real group are tested in ``test_sync_processes.py`` and ``test_sync_pairings.py``; here the
layout and the verdicts on crafted headers, including the summed headers of an ``all_reduce`` (accelerators),
which the CPU tests never produce.
"""

from __future__ import annotations

import re

import pytest
import torch

from pc_sync import _exchange as ex


def _head(
    kind: float = 1.0, channels: int = 3, dtype: torch.dtype = torch.float32, **extra: float
) -> list[float]:
    ordinal = int(extra.pop("ordinal", 0))
    return ex._header(kind, channels, ex.dtype_code(dtype), ordinal, 8, **extra)


def test_packet_is_header_then_two_slots_of_the_groups_width() -> None:
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    packet = ex._packet(_head(channels=2), a, b, width=4)
    assert packet.dtype == torch.float64
    assert packet.numel() == ex.HEADER + 2 * 4
    assert packet[ex.HEADER :].tolist() == [1.0, 2.0, 0.0, 0.0, 3.0, 4.0, 0.0, 0.0]
    # a call wider than the group's packets sends its header alone, in a packet of the same size
    wide = ex._packet(_head(channels=6), torch.ones(6), torch.ones(6), width=4)
    assert wide.numel() == packet.numel()
    assert wide[ex.HEADER :].abs().sum() == 0


def test_forward_headers_that_agree_pass() -> None:
    ex._check_forward([_head(count=3.0, records=1.0), _head(count=0.0, records=1.0, replicas=2.0)])


@pytest.mark.parametrize(
    ("other", "words"),
    [
        (_head(channels=4), "different channel counts (rank 0: 3 channels, float32, no replicas; rank 1: 4"),
        (_head(dtype=torch.float64), "different input dtypes"),
        (_head(kind=2.0), "rank(s) [1] of the process group are in a layer's backward exchange"),
        (_head(records=1.0), "ranks [0] of the process group run this layer without autograd recording"),
        (_head(ordinal=5), "different numbers of recording layer calls"),
        ([7.0] * ex.HEADER, "rank(s) [1] of the process group sent a packet of another format"),
    ],
)
def test_forward_headers_that_differ_raise_a_value_error_naming_it(other: list[float], words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        ex._check_forward([_head(), other])


def test_backward_headers_of_other_calls_raise() -> None:
    ex._check_backward([_head(2.0, ordinal=4), _head(2.0, ordinal=4)], 0, 4)
    for other in (_head(2.0, ordinal=5), _head(2.0, channels=4, ordinal=4), _head(1.0, ordinal=4)):
        with pytest.raises(RuntimeError, match="backward in different orders"):
            ex._check_backward([_head(2.0, ordinal=4), other], 0, 4)


def _summed(*heads: list[float]) -> list[float]:
    return [sum(values) for values in zip(*heads, strict=True)]


def test_summed_backward_headers_prove_equality_with_their_squares() -> None:
    same = [_head(2.0, channels=4, ordinal=9) for _ in range(3)]
    ex._check_summed(_summed(*same), 3, 0, 9, 4, ex.dtype_code(torch.float32))
    # 3 + 5 channels sum like 4 + 4: the squares tell them apart
    crossed = [_head(2.0, channels=3, ordinal=9), _head(2.0, channels=5, ordinal=9)]
    with pytest.raises(RuntimeError, match="backward in different orders"):
        ex._check_summed(_summed(*crossed), 2, 0, 9, 4, ex.dtype_code(torch.float32))
    calls = [_head(2.0, channels=4, ordinal=8), _head(2.0, channels=4, ordinal=10)]
    with pytest.raises(RuntimeError, match="backward in different orders"):
        ex._check_summed(_summed(*calls), 2, 0, 9, 4, ex.dtype_code(torch.float32))
    forward = [_head(2.0, channels=4, ordinal=9), _head(1.0, channels=4, ordinal=9)]
    with pytest.raises(RuntimeError, match="backward in different orders"):
        ex._check_summed(_summed(*forward), 2, 0, 9, 4, ex.dtype_code(torch.float32))


def test_state_is_kept_per_group_object() -> None:
    class Group:  # weakly referenceable, like torch's ProcessGroup
        pass

    first, second = Group(), Group()
    ex.state_of(first).width = 12
    assert ex.state_of(first).width == 12
    assert ex.state_of(second).width == 0
    unhashable_by_weakref = object()  # no weak reference: kept alive, still its own state
    ex.state_of(unhashable_by_weakref).ordinal = 3
    assert ex.state_of(unhashable_by_weakref).ordinal == 3
