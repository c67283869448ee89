"""Bad input, unpicklable objects with their access paths, corrupt payloads, and no global state at import."""

from __future__ import annotations

import io
import pickle
import sys
import threading
from collections.abc import Iterator

import pytest
import torch
from torch.multiprocessing import reductions

import pc_pickle
from pc_pickle import _payload, _seal, _tensors

pytestmark = pytest.mark.filterwarnings("error")


def _generator() -> Iterator[int]:
    yield 1


def test_unpicklable_attribute_path_in_module() -> None:
    model = torch.nn.Linear(2, 2)
    model.hook = _generator()  # type: ignore[assignment]  # neither pickle nor dill can pickle a generator
    with pytest.raises(pc_pickle.UnpicklableObjectError) as info:
        pc_pickle.dumps({"model": model})
    assert str(info.value).startswith("obj['model'].hook: cannot pickle builtins.generator object")
    assert info.value.path == "obj['model'].hook"
    assert isinstance(info.value, pickle.PicklingError)
    assert isinstance(info.value.__cause__, TypeError)


def test_unpicklable_closure_variable_path() -> None:
    gen = _generator()
    with pytest.raises(
        pickle.PicklingError, match=r"^obj\[2\]\.<closure>\.gen: cannot pickle builtins\.generator"
    ):
        pc_pickle.dumps([1, 2, lambda: gen])


class _RefusesToTravel:
    """Holds an unpicklable attribute but says itself why it cannot be pickled."""

    def __init__(self) -> None:
        self.gen = _generator()

    def __reduce__(self) -> object:
        raise TypeError("a _RefusesToTravel stays where it was made")


class _ReducesToItsGenerator:
    def __init__(self) -> None:
        self.harmless = 1
        self.gen = _generator()

    def __reduce__(self) -> object:
        return (list, (self.gen,))


def test_an_object_whose_own_reduce_refuses_is_the_culprit_not_its_attributes() -> None:
    with pytest.raises(pc_pickle.UnpicklableObjectError) as info:
        pc_pickle.dumps({"held": [_RefusesToTravel()]})
    assert info.value.path == "obj['held'][0]"
    assert "stays where it was made" in str(info.value)
    # an object that reduces itself is walked through what its reduce returns, not through its attributes
    with pytest.raises(pc_pickle.UnpicklableObjectError) as info:
        pc_pickle.dumps([_ReducesToItsGenerator()])
    assert info.value.path == "obj[0].<reduce arg 0>"


def test_objects_only_dill_can_pickle_are_pickled() -> None:
    model = torch.nn.Linear(2, 2)
    model.lock = threading.Lock()  # type: ignore[assignment]
    out = pc_pickle.loads(pc_pickle.dumps({"model": model, "prop": property(len), "keys": {"a": 1}.keys()}))
    assert out["model"].lock.acquire(timeout=1)
    assert out["prop"].fget is len
    assert list(out["keys"]) == ["a"]


def test_unpicklable_in_nested_submodule_and_pickler_writes_nothing() -> None:
    outer = torch.nn.Sequential(torch.nn.Sequential(torch.nn.ReLU()))
    outer[0][0].gen = _generator()  # type: ignore[assignment]
    buf = io.BytesIO()
    with pytest.raises(pc_pickle.UnpicklableObjectError, match=r"^obj\.0\.0\.gen: "):
        pc_pickle.Pickler(buf).dump(outer)
    assert buf.getvalue() == b""


def test_deep_graph_gives_picklingerror_with_depth() -> None:
    deep: list[object] = []
    node = deep
    # Python 3.12+ pickles far deeper than the recursion limit (its C stack guard is separate): go past both
    for _ in range(max(sys.getrecursionlimit() * 2, 200_000)):
        node.append([])
        node = node[0]  # type: ignore[assignment]
    with pytest.raises(pc_pickle.UnpicklableObjectError, match=r"nested too deeply.*recursion limit"):
        pc_pickle.dumps(deep)


def test_self_referencing_graph_round_trips() -> None:
    a: dict[str, object] = {"t": torch.ones(1)}
    a["self"] = a
    out = pc_pickle.loads(pc_pickle.dumps(a))
    assert out["self"] is out


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: pc_pickle.dumps(1, recurse=1), "recurse must be a bool, got int"),
        (lambda: pc_pickle.dumps(1, copy_tensor="yes"), "copy_tensor must be a bool, got str"),
        (lambda: pc_pickle.Pickler("out.pkl"), "file must be a binary file"),
        (lambda: pc_pickle.Pickler(io.BytesIO(), copy_tensor=None), "copy_tensor must be a bool"),
        (lambda: pc_pickle.loads("text"), "loads expects bytes, bytearray or memoryview, got str"),
    ],
)
def test_bad_arguments_raise_typeerror(call: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        call()  # type: ignore[operator]


def test_truncated_payload_raises_unpicklingerror() -> None:
    data = pc_pickle.dumps({"t": torch.arange(100.0), "f": lambda: 1})
    for cut in (1, 10, 40, len(data) // 2, len(data) - 1):
        with pytest.raises(pickle.UnpicklingError):
            pc_pickle.loads(data[:cut])


def test_foreign_bytes_raise_payloaderror() -> None:
    for foreign in (b"", b"hello", pickle.dumps({"a": 1}), bytes(range(256)), b"\x80\x05" + b"\xff" * 100):
        with pytest.raises(pc_pickle.PayloadError, match="not a pc_pickle payload"):
            pc_pickle.loads(foreign)


def test_corrupt_graph_inside_a_valid_header_raises_payloaderror() -> None:
    good = pc_pickle.dumps([torch.ones(2), "x" * 200])
    corrupt = bytearray(good)
    corrupt[len(good) // 2 : len(good) // 2 + 8] = b"\xff" * 8
    with pytest.raises(pc_pickle.PayloadError, match="checksum mismatch"):
        pc_pickle.loads(bytes(corrupt))


def test_format_version_mismatch_names_both_versions() -> None:
    class Future(_payload.Payload):
        def __reduce__(self) -> tuple[object, ...]:
            load, (_, table, graph) = super().__reduce__()
            return (load, (99, table, graph))

    data = b"".join(_seal.seal([pickle.dumps(Future([], pickle.dumps(1)), protocol=5)]))
    with pytest.raises(pc_pickle.PayloadError, match=rf"version 99 .* version {_payload.FORMAT_VERSION}"):
        pc_pickle.loads(data)


def test_header_of_another_format_version_names_both_versions() -> None:
    data = bytearray(pc_pickle.dumps([1, 2]))
    data[11:13] = (7).to_bytes(2, "little")  # the header's version field, checked before the checksum
    with pytest.raises(pc_pickle.PayloadError, match=rf"version 7 .* version {_seal.FORMAT_VERSION}"):
        pc_pickle.loads(bytes(data))


def test_missing_cuda_device_is_named() -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    entry = (0, "cuda:3", bytearray(4))
    with pytest.raises(pc_pickle.PayloadError, match="cuda:3"):
        _tensors.materialize_entry(entry)


def test_share_reducers_match_what_torch_registers_globally() -> None:
    from multiprocessing.reduction import ForkingPickler

    registered = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    for cls, reducer in _tensors.SHARE_REDUCERS.items():
        if cls is torch.cuda.Event:
            continue  # pc's own reducer (torch's is private on some releases): tested below
        assert registered[cls] is reducer, cls
    assert registered[torch.FloatStorage] is reductions.reduce_typed_storage_child


def test_cuda_event_reducer_uses_public_event_methods_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch 2.15 made its event reducer private; pc's needs only Event.ipc_handle and Event.from_ipc_handle,
    # which every supported torch has. A stand-in event keeps this test on CPU.
    class FakeEvent:
        device = torch.device("cuda", 1)

        def ipc_handle(self) -> bytes:
            return b"handle-bytes"

    opened: list[tuple[object, bytes]] = []
    monkeypatch.setattr(
        torch.cuda.Event, "from_ipc_handle", staticmethod(lambda d, h: opened.append((d, h)) or "ev")
    )
    rebuild, args = _tensors.reduce_cuda_event(FakeEvent())  # type: ignore[arg-type]
    assert args == (torch.device("cuda", 1), b"handle-bytes")
    assert rebuild(*args) == "ev"
    assert opened == [(torch.device("cuda", 1), b"handle-bytes")]
    assert _tensors.SHARE_REDUCERS[torch.cuda.Event] is _tensors.reduce_cuda_event
