"""The c10d backend's pickling: by name where a name loads (as torch's RPC), else by value; tensors aside."""

from __future__ import annotations

import socket
import sys
from typing import Any

import pytest
import torch

from pc_distributed.rpc._c10d_codec import decode, encode


def _round_trip(obj: Any) -> tuple[bytes, Any]:
    data = encode(obj, "the call")
    return data[:1], decode(memoryview(data))


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


def test_tensors_are_set_aside_and_keep_their_sharing() -> None:
    t = torch.arange(6.0)
    view = t[2:]
    form, (a, b, again) = _round_trip((t, view, t))
    assert form != b"R"
    assert a is again
    assert torch.equal(a, t)
    assert torch.equal(b, view)
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    assert a.data_ptr() != t.data_ptr()  # a copy, not the sender's memory


def test_what_only_dill_pickles_goes_whole_by_value() -> None:
    items = {"a": 1}.items()
    form, (out, fn) = _round_trip((items, named))
    assert form != b"R"
    assert list(out) == [("a", 1)]
    assert fn(1) == 2


def test_what_neither_can_pickle_is_a_type_error_naming_it() -> None:
    with socket.socket() as sock, pytest.raises(TypeError, match=r"the call cannot be pickled: .*socket"):
        encode((named, (sock,)), "the call")
