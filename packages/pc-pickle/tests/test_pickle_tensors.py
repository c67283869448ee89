"""Copy round trips of tensors, parameters, storages and modules (copy_tensor=True)."""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Callable

import pytest
import torch

import pc_pickle

pytestmark = pytest.mark.filterwarnings("error")

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]


def _base(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    values = torch.randn(4, 6, generator=g, dtype=torch.float64) * 50
    if dtype.is_complex:
        return torch.complex(values, values.flip(0)).to(dtype)
    if dtype is torch.bool:
        return values > 0
    return values.to(dtype)


SHAPES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "contiguous": lambda t: t,
    "0-d": lambda t: t[1, 2],
    "empty": lambda t: t[:0],
    "transposed": lambda t: t.t(),
    "sliced-offset": lambda t: t[1:3, 2:5],
    "expanded-stride0": lambda t: t[0:1].expand(3, 6),
}


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert type(a) is type(b)
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert a.stride() == b.stride()
    assert a.storage_offset() == b.storage_offset()
    assert a.device == b.device
    assert a.requires_grad == b.requires_grad
    assert torch.equal(a.detach(), b.detach())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_copy_round_trip_every_dtype_and_layout(dtype: torch.dtype, shape: str) -> None:
    t = SHAPES[shape](_base(dtype))
    out = pc_pickle.loads(pc_pickle.dumps(t))
    _assert_same(out, t)
    assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_copy_is_independent_of_the_sender() -> None:
    t = torch.zeros(5)
    out = pc_pickle.loads(pc_pickle.dumps(t))
    out.add_(1)
    assert torch.equal(t, torch.zeros(5))
    assert not out.is_shared()


def test_requires_grad_parameter_and_non_leaf() -> None:
    leaf = torch.randn(3, requires_grad=True)
    param = torch.nn.Parameter(torch.randn(2, 2))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    non_leaf = leaf * 2
    out = pc_pickle.loads(pc_pickle.dumps([leaf, param, frozen, non_leaf]))
    _assert_same(out[0], leaf)
    _assert_same(out[1], param)
    _assert_same(out[2], frozen)
    assert isinstance(out[1], torch.nn.Parameter)
    assert isinstance(out[2], torch.nn.Parameter)
    assert out[3].is_leaf
    assert out[3].requires_grad
    assert torch.equal(out[3].detach(), non_leaf.detach())
    assert out[3].grad_fn is None


def test_views_of_one_storage_stay_aliased() -> None:
    base = torch.arange(12.0)
    views = {"base": base, "mat": base.view(3, 4), "t": base.view(3, 4).t(), "tail": base[6:]}
    out = pc_pickle.loads(pc_pickle.dumps(views))
    ptrs = {k: v.untyped_storage().data_ptr() for k, v in out.items()}
    assert len(set(ptrs.values())) == 1
    out["base"][7] = -1.0
    assert out["tail"][1].item() == -1.0
    assert out["t"][3, 1].item() == -1.0
    # The same tensor object twice stays one object.
    a, b = pc_pickle.loads(pc_pickle.dumps([base, base]))
    assert a is b


def test_module_state_dict_and_tied_weights() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=True))
    model[1].weight = model[0].weight  # tied
    out = pc_pickle.loads(pc_pickle.dumps({"model": model, "sd": model.state_dict()}))
    loaded = out["model"]
    assert loaded[1].weight is loaded[0].weight
    x = torch.tensor([1, 2, 3])
    assert torch.equal(loaded(x), model(x))
    for key, value in model.state_dict().items():
        _assert_same(out["sd"][key], value)
    assert (
        out["sd"]["0.weight"].untyped_storage().data_ptr()
        == out["sd"]["1.weight"].untyped_storage().data_ptr()
    )


def test_untyped_storage_round_trip_keeps_its_class() -> None:
    t = torch.arange(4, dtype=torch.int32)
    storage = t.untyped_storage()
    out_storage, out_t = pc_pickle.loads(pc_pickle.dumps([storage, t]))
    assert type(out_storage) is torch.UntypedStorage
    assert out_storage.nbytes() == 16
    assert out_t.untyped_storage().data_ptr() == out_storage.data_ptr()


def test_special_tensors_fall_back_to_torch() -> None:
    sparse = torch.eye(3).to_sparse()
    conj = torch.tensor([1 + 2j]).conj()
    with warnings.catch_warnings():
        # some torch releases (2.11) warn that sparse invariant checks are off when rebuilding a sparse tensor
        warnings.simplefilter("ignore", UserWarning)
        out_sparse, out_conj = pc_pickle.loads(pc_pickle.dumps([sparse, conj]))
    assert out_sparse.is_sparse
    assert torch.equal(out_sparse.to_dense(), torch.eye(3))
    assert torch.equal(out_conj.resolve_conj(), conj.resolve_conj())


def test_payload_is_compact_and_plain_pickle_reads_it() -> None:
    tiny = [torch.tensor([float(i)]) for i in range(100)]
    data = pc_pickle.dumps(tiny)
    assert len(data) < 0.5 * len(pickle.dumps(tiny, protocol=5))
    out = pickle.loads(data)  # an ordinary pickle: the top-level call is importable
    assert all(torch.equal(a, b) for a, b in zip(out, tiny, strict=False))


def test_pickler_writes_several_payloads_to_one_file() -> None:
    buf = io.BytesIO()
    pickler = pc_pickle.Pickler(buf, copy_tensor=True)
    first, second = torch.ones(3), {"x": torch.zeros(2), "f": lambda v: v * 2}
    pickler.dump(first)
    pickler.dump(second)
    buf.seek(0)
    assert torch.equal(pickle.load(buf), first)
    loaded = pickle.load(buf)
    assert torch.equal(loaded["x"], torch.zeros(2))
    assert loaded["f"](4) == 8


def test_plain_objects_round_trip() -> None:
    obj = {"a": [1, 2.5, "x", None, True], "b": (b"\x00", {3}), "c": frozenset({1}), 4: torch.float16}
    assert pc_pickle.loads(pc_pickle.dumps(obj)) == obj
    assert pc_pickle.loads(bytearray(pc_pickle.dumps(obj))) == obj
    assert pc_pickle.loads(memoryview(pc_pickle.dumps(obj))) == obj


@pytest.mark.gpu
def test_cuda_copy_round_trip_keeps_device() -> None:
    t = torch.arange(10.0, device="cuda").view(2, 5).t()
    out = pc_pickle.loads(pc_pickle.dumps({"t": t, "p": torch.nn.Parameter(t.clone())}))
    _assert_same(out["t"], t)
    assert out["p"].device == t.device
    assert isinstance(out["p"], torch.nn.Parameter)
    out["t"].add_(1)
    assert torch.equal(t, torch.arange(10.0, device="cuda").view(2, 5).t())
