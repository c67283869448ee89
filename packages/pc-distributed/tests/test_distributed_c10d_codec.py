"""The c10d backend's pickling: by name where a name loads (as torch's RPC), else by value; tensors aside."""

from __future__ import annotations

import socket
import sys
from typing import Any

import pytest
import torch

from pc_distributed.rpc._c10d.codec import PART_MIN_BYTES, Encoded, decode, encode


def _round_trip(obj: Any) -> tuple[bytes, Any]:
    message = encode(obj, "the call")
    return message.head[:1], decode(memoryview(message.head), _received(message))


def _received(message: Encoded) -> tuple[torch.Tensor, ...]:
    """The parts as a receiver has them: fresh memory with the same bytes."""
    return tuple(p.clone() for p in message.parts)


def named(x: int) -> int:
    return x + 1


def test_plain_values_and_named_functions_are_one_plain_pickle() -> None:
    form, out = _round_trip((named, (1, "a"), {"k": [2.0]}))
    assert form == b"R"
    assert out[0] is named  # by name: the receiver's own function, not a copy
    assert out[1:] == ((1, "a"), {"k": [2.0]})


def test_a_main_function_goes_by_name_not_with_a_copy_of_the_senders_globals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def script_function() -> int:
        return 7

    script_function.__module__ = "__main__"
    script_function.__qualname__ = "script_function"
    monkeypatch.setattr(sys.modules["__main__"], "script_function", script_function, raising=False)
    form, out = _round_trip((script_function, ()))
    assert form == b"R"
    assert out[0] is script_function


def test_lambdas_closures_and_local_classes_go_by_value() -> None:
    k = 5

    class Local:
        def __init__(self) -> None:
            self.v = 3

    form, (fn, obj, also) = _round_trip((lambda x: x + k, Local(), named))
    assert form != b"R"
    assert fn(1) == 6
    assert type(obj).__name__ == "Local"
    assert type(obj) is not Local  # rebuilt from its value
    assert obj.v == 3
    assert also is named  # the named function beside them still goes by name


def test_small_tensors_ride_in_the_plain_pickle_and_keep_their_sharing() -> None:
    t = torch.arange(6.0)
    view = t[2:]
    message = encode((t, view, t), "the call")
    assert message.head[:1] == b"R"  # nothing by value
    assert message.parts == ()  # small storages are copied into the head
    a, b, again = decode(memoryview(message.head))
    assert a is again
    assert torch.equal(a, t)
    assert torch.equal(b, view)
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    assert a.data_ptr() != t.data_ptr()  # a copy, not the sender's memory


def test_a_large_storage_is_one_part_read_from_the_tensors_own_memory() -> None:
    big = torch.randn(PART_MIN_BYTES // 4, requires_grad=True)
    matrix = big.detach().view(-1, 64).t()  # another view of the same storage, not contiguous
    message = encode({"big": big, "matrix": matrix, "again": big}, "the call")
    assert [p.numel() for p in message.parts] == [PART_MIN_BYTES]  # one part for the shared storage
    assert message.parts[0].data_ptr() == big.data_ptr()  # no copy on the sending side
    parts = _received(message)
    out = decode(memoryview(message.head), parts)
    assert out["again"] is out["big"]
    assert torch.equal(out["big"], big)
    assert out["big"].requires_grad
    assert out["big"].is_leaf
    assert torch.equal(out["matrix"], matrix)
    assert out["matrix"].stride() == matrix.stride()
    storage = out["big"].untyped_storage().data_ptr()
    assert storage == out["matrix"].untyped_storage().data_ptr() == parts[0].data_ptr()  # owns the part


def test_a_small_view_of_a_large_storage_sends_only_its_elements() -> None:
    big = torch.arange(float(PART_MIN_BYTES))  # 4 x PART_MIN_BYTES bytes
    head = big[:16]
    message = encode((head,), "the call")
    assert message.parts == ()  # a compact copy of 64 bytes, inline
    (out,) = decode(memoryview(message.head))
    assert torch.equal(out, head)
    assert out.untyped_storage().nbytes() == 16 * 4


def test_a_view_spanning_a_large_storage_sends_it_whole_and_later_views_share_it() -> None:
    big = torch.arange(float(PART_MIN_BYTES))
    column = big.view(-1, 8)[:, 3]  # one element in eight, but spanning the storage
    head = big[:16]  # sent after it: a view of the storage already sent
    message = encode((column, head), "the call")
    assert [p.numel() for p in message.parts] == [big.untyped_storage().nbytes()]
    out_column, out_head = decode(memoryview(message.head), _received(message))
    assert torch.equal(out_column, column)
    assert torch.equal(out_head, head)
    assert out_head.untyped_storage().data_ptr() == out_column.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    "tensor",
    [
        torch.zeros(0, 3),
        torch.arange(10, dtype=torch.int16),
        torch.tensor([True, False]),
        torch.randn(3, 4).to(torch.bfloat16),
        torch.randn(4, 4, dtype=torch.complex64).conj(),
        torch.randn(2, 3).to_sparse(),
        torch.nn.Parameter(torch.randn(3)),
    ],
    ids=["empty", "int16", "bool", "bfloat16", "conjugated", "sparse", "parameter"],
)
def test_every_kind_of_tensor_arrives_equal_with_its_type(tensor: torch.Tensor) -> None:
    _, (out,) = _round_trip((tensor,))
    assert type(out) is type(tensor)
    assert (out.dtype, out.shape, out.layout) == (tensor.dtype, tensor.shape, tensor.layout)
    assert out.requires_grad == tensor.requires_grad
    assert torch.equal(out.detach().to_dense(), tensor.detach().to_dense())


def test_a_snapshot_does_not_see_later_writes() -> None:
    big = torch.zeros(PART_MIN_BYTES // 4)
    message = encode((big,), "the call")
    snapshot = message.snapshot()
    big += 1
    (as_sent,) = decode(memoryview(snapshot.head), snapshot.parts)
    (read_late,) = decode(memoryview(message.head), message.parts)
    assert float(as_sent.sum()) == 0.0
    assert float(read_late.sum()) == big.numel()  # without the snapshot, the parts read the memory as it is


def test_a_head_of_another_form_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="not a message of the c10d codec"):
        decode(memoryview(b"Xjunk"))


def test_what_only_dill_pickles_goes_whole_by_value() -> None:
    items = {"a": 1}.items()
    form, (out, fn) = _round_trip((items, named))
    assert form != b"R"
    assert list(out) == [("a", 1)]
    assert fn(1) == 2


def test_what_neither_can_pickle_is_a_type_error_naming_it() -> None:
    with socket.socket() as sock, pytest.raises(TypeError, match=r"the call cannot be pickled: .*socket"):
        encode((named, (sock,)), "the call")


def test_a_snapshot_copies_only_the_parts_that_are_not_copies_already() -> None:
    shared, private = torch.zeros(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8)
    message = Encoded(b"R", (shared, private), frozenset({1}))
    snapshot = message.snapshot()
    assert snapshot.parts[1] is private  # a host copy of a device storage is not copied again
    assert snapshot.parts[0] is not shared
    assert torch.equal(snapshot.parts[0], shared)
    assert snapshot.staged == frozenset({1})
    assert Encoded(b"R", (private,), frozenset({0})).snapshot().parts[0] is private


def test_a_tensor_for_a_cuda_device_the_receiver_lacks_is_a_value_error_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pc_distributed.rpc._c10d import codec as codec_module

    missing = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
    as_sent = codec_module._SetAsidePickler._tensor_pid

    def from_a_device(self: Any, key: int, tensor: torch.Tensor) -> tuple[Any, ...]:
        return (*as_sent(self, key, tensor)[:-1], missing)  # what a sender on that device writes

    monkeypatch.setattr(codec_module._SetAsidePickler, "_tensor_pid", from_a_device)
    for size in (4, PART_MIN_BYTES):  # inside the pickle, and as a part
        message = encode((torch.zeros(size, dtype=torch.uint8),), "the call")
        with pytest.raises(ValueError, match=f"arrived for {missing}.*CUDA device"):
            decode(memoryview(message.head), _received(message))


@pytest.mark.gpu
def test_cuda_tensors_cross_as_one_host_copy_each_way_and_keep_their_device_and_sharing() -> None:
    big = torch.arange(PART_MIN_BYTES // 2, dtype=torch.float32, device="cuda:0")
    small = torch.arange(6.0, device="cuda:0").reshape(2, 3)
    message = encode((big, big[10:], small, small.t(), torch.ones(2)), "the call")
    assert len(message.parts) == 1
    assert message.staged == frozenset({0})
    assert message.parts[0].device.type == "cpu"
    assert message.parts[0].is_pinned()
    big.zero_()  # the part is a copy made at encode: later writes on the device do not reach it
    got_big, got_view, got_small, got_t, host = decode(memoryview(message.head), _received(message))
    assert (got_big.device, got_small.device, host.device) == (big.device, small.device, torch.device("cpu"))
    assert torch.equal(got_big.cpu(), torch.arange(PART_MIN_BYTES // 2, dtype=torch.float32))
    assert got_view.untyped_storage().data_ptr() == got_big.untyped_storage().data_ptr()
    assert got_t.stride() == (1, 3)
    assert torch.equal(got_t.cpu(), small.t().cpu())
    assert message.snapshot().parts[0] is message.parts[0]
