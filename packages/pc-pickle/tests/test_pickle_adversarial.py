"""Property-based tests of pc_pickle: arbitrary object graphs round-trip, or fail with the documented error.

Graphs are drawn by hypothesis from the standard library's value types and containers, torch tensors of every
kind (dtypes, views, non-contiguous strides, offsets, Parameters, aliasing), and file handles and sockets
placed anywhere in them (refused at ``dumps`` with the access path, or with ``read_files=True`` reopened
read-only). ``nox -s tests`` runs a few examples (derandomized: the same ones on every run);
``nox -s adversarial`` runs ``PC_ADVERSARIAL_EXAMPLES`` of them; ``PC_ADVERSARIAL_SEED=N`` explores other
examples. A failure prints hypothesis's falsifying example and the seed line.
"""

from __future__ import annotations

import collections
import datetime
import decimal
import fractions
import math
import socket
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import pc_pickle

pytestmark = pytest.mark.adversarial


# -- the standard library's values ---------------------------------------------------------------------------
_hashable = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.complex_numbers(allow_nan=False),
    st.decimals(allow_nan=False),
    st.fractions(),
    st.datetimes(),
    st.dates(),
    st.timedeltas(),
    st.uuids(),
    st.just(math.inf),
    st.just(Ellipsis),
    st.sampled_from([int, str, collections.OrderedDict, uuid.UUID, datetime.timezone.utc]),
)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(_hashable, children, max_size=4),
        st.dictionaries(st.text(max_size=4), children, max_size=4).map(collections.OrderedDict),
        st.lists(children, max_size=4).map(collections.deque),
        st.frozensets(_hashable, max_size=4),
        st.sets(_hashable, max_size=4),
        st.dictionaries(st.text(max_size=4), st.integers(), max_size=4).map(collections.Counter),
        st.lists(children, max_size=3).map(lambda xs: [xs, xs]),  # the same list twice: shared after load
        st.binary(max_size=16).map(bytearray),
    )


graphs = st.recursive(_hashable, _containers, max_leaves=20)


@given(graphs)
def test_standard_library_graphs_round_trip(obj: Any) -> None:
    out = pc_pickle.loads(pc_pickle.dumps(obj))
    assert out == obj
    assert type(out) is type(obj)
    if isinstance(obj, list) and len(obj) == 2 and obj[0] is obj[1]:
        assert out[0] is out[1]


# -- tensors --------------------------------------------------------------------------------
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


@st.composite
def tensors(draw: st.DrawFn) -> dict[str, Any]:
    """A base tensor, one view of it (slice, transpose, narrow, expand-free reshape) and a Parameter."""
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    numel = math.prod(shape)
    values = torch.tensor(draw(st.lists(st.integers(-100, 100), min_size=numel, max_size=numel)))
    base = values.reshape(shape).to(dtype) if dtype is not torch.bool else (values.reshape(shape) > 0)
    kind = draw(st.sampled_from(["t", "slice", "narrow", "flip_stride", "same"]))
    if kind == "t" and base.dim() >= 2:
        view = base.transpose(0, base.dim() - 1)
    elif kind == "slice":
        view = base[..., :: draw(st.integers(1, 3))]
    elif kind == "narrow":
        start = draw(st.integers(0, shape[0] - 1))
        view = base.narrow(0, start, shape[0] - start)
    elif kind == "flip_stride" and base.dim() >= 2:
        view = base.permute(*reversed(range(base.dim())))
    else:
        view = base
    out: dict[str, Any] = {"base": base, "view": view}
    if dtype.is_floating_point or dtype.is_complex:
        out["param"] = torch.nn.Parameter(base.clone(), requires_grad=draw(st.booleans()))
    return out


@given(tensors(), st.booleans())
def test_tensors_of_every_kind_round_trip_with_aliasing(graph: dict[str, Any], copy_tensor: bool) -> None:
    payload = pc_pickle.dumps(graph, copy_tensor=copy_tensor)
    out = pc_pickle.loads(payload)
    for key, t in graph.items():
        got = out[key]
        assert type(got) is type(t)
        assert (got.dtype, got.shape, got.stride(), got.storage_offset()) == (
            t.dtype,
            t.shape,
            t.stride(),
            t.storage_offset(),
        )
        assert torch.equal(got, t)
        assert got.requires_grad == t.requires_grad
    base, view = out["base"], out["view"]
    assert base.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()


# -- file handles and sockets anywhere in a graph --------------------------------------------------
@st.composite
def placed(draw: st.DrawFn, leaf: Any) -> Any:
    """``leaf`` placed at a random depth of a random container graph."""
    obj = leaf
    for _ in range(draw(st.integers(0, 3))):
        wrap = draw(st.sampled_from(["list", "tuple", "dict", "closure"]))
        others = draw(st.lists(_hashable, max_size=2))
        if wrap == "list":
            obj = [*others, obj]
        elif wrap == "tuple":
            obj = (obj, *others)
        elif wrap == "dict":
            obj = {draw(st.text(max_size=3)): obj, **{f"k{i}": v for i, v in enumerate(others)}}
        else:
            obj = _closure_over(obj)
    return obj


def _closure_over(value: Any) -> Callable[[], Any]:
    return lambda: value


def _find(obj: Any, path: str) -> Any:
    """Follow an access path such as ``obj['a'][0].<closure>.value`` from ``obj``."""
    expr = path.replace(".<closure>.value", ".__closure__[0].cell_contents")
    return eval(expr, {"obj": obj})  # a path pc_pickle wrote, over a graph this test built


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "data.bin"
    path.write_bytes(b"0123456789")
    return path


@pytest.mark.parametrize("mode", ["w", "ab", "r+", "r", "rb"])
def test_file_handles_anywhere_are_refused_with_their_path(data_file: Path, mode: str) -> None:
    with open(data_file, mode) as handle:

        @given(placed(handle), st.booleans())
        def check(obj: Any, read_files: bool) -> None:
            readable_only = mode in ("r", "rb")
            if read_files and readable_only:
                out = pc_pickle.loads(pc_pickle.dumps(obj, read_files=True))
                del out  # loaded handles are closed when collected
                return
            with pytest.raises(pc_pickle.UnpicklableObjectError) as info:
                pc_pickle.dumps(obj, read_files=read_files)
            assert _find(obj, info.value.path) is handle, info.value.path

        check()
    assert data_file.read_bytes() == (b"" if mode == "w" else b"0123456789")


def test_read_only_handles_reopen_at_their_position(data_file: Path) -> None:
    @given(st.integers(0, 10), st.sampled_from(["r", "rb"]))
    def check(position: int, mode: str) -> None:
        with open(data_file, mode) as handle:
            handle.read(position)
            payload = pc_pickle.dumps({"h": handle}, read_files=True)
        with pc_pickle.loads(payload)["h"] as again:
            rest = again.read()
        assert rest == ("0123456789"[position:] if mode == "r" else b"0123456789"[position:])
        assert data_file.read_bytes() == b"0123456789"

    check()


def test_sockets_anywhere_are_refused_with_their_path() -> None:
    with socket.socket() as sock:

        @given(placed(sock), st.booleans())
        def check(obj: Any, read_files: bool) -> None:
            with pytest.raises(pc_pickle.UnpicklableObjectError, match="outside the process") as info:
                pc_pickle.dumps(obj, read_files=read_files)
            assert _find(obj, info.value.path) is sock

        check()


def test_fractions_and_decimals_keep_their_exact_value() -> None:
    @given(st.fractions(), st.decimals(allow_nan=False, allow_infinity=False))
    def check(f: fractions.Fraction, d: decimal.Decimal) -> None:
        out = pc_pickle.loads(pc_pickle.dumps((f, d)))
        assert out[0] == f
        assert str(out[1]) == str(d)

    check()
