"""Packing of large tensors: kept separate, shared only with ``copy=False``, always compact and in order."""

from __future__ import annotations

import pytest
import torch
from server_fakegroup import Hub
from server_models import Wide

from pc_server import OrderedServerBase, PushPullModelServer, PushPullModelServerImpl
from pc_server._packing import SEPARATE_BYTES, pack, unpack
from pc_server._state import model_snapshot


def _source() -> dict[str, object]:
    n = SEPARATE_BYTES // 4  # float32 elements in one separate tensor
    base = torch.arange(4 * n, dtype=torch.float32)
    return {
        "small": torch.ones(3),
        "big": torch.randn(n),
        "view": base[n : 2 * n + 8],  # large, a slice of a bigger storage
        "t": torch.randn(64, n // 64).t(),  # large, not contiguous
        "int": torch.arange(5),
        "extra": "kept",
        "big64": torch.zeros(n, dtype=torch.float64),
    }


def test_pack_keeps_large_tensors_separate_and_in_order() -> None:
    src = _source()
    packed = pack(src)
    assert set(packed.large) == {"big", "view", "t", "big64"}
    assert {dt: int(b.numel()) for dt, b in packed.buffers.items()} == {torch.float32: 3, torch.int64: 5}
    assert packed.numel() == sum(t.numel() for t in src.values() if isinstance(t, torch.Tensor))
    out = unpack(packed)
    assert list(out) == ["small", "big", "view", "t", "int", "big64", "extra"]
    for name, value in src.items():
        if isinstance(value, torch.Tensor):
            assert out[name].dtype == value.dtype, name
            assert torch.equal(out[name], value), name
    assert out["extra"] == "kept"
    for tensor in packed.large.values():  # compact: each travels without the rest of a storage
        assert tensor.is_contiguous()
        assert tensor.storage_offset() == 0
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    on_cpu = unpack(packed, "cpu")
    assert all(torch.equal(on_cpu[k], out[k]) for k in packed.names)


def test_pack_copy_true_shares_nothing() -> None:
    src = _source()
    packed = pack(src)
    for name in packed.large:
        assert packed.large[name].untyped_storage().data_ptr() != src[name].untyped_storage().data_ptr()  # type: ignore[union-attr]
    before = {k: v.clone() for k, v in unpack(packed).items() if isinstance(v, torch.Tensor)}
    for value in src.values():
        if isinstance(value, torch.Tensor):
            value.add_(1)
    after = unpack(packed)
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_pack_copy_false_shares_only_compact_cpu_tensors() -> None:
    src = _source()
    packed = pack(src, copy=False)
    assert packed.large["big"].data_ptr() == src["big"].data_ptr()  # type: ignore[union-attr]
    assert packed.large["big64"].data_ptr() == src["big64"].data_ptr()  # type: ignore[union-attr]
    assert packed.large["view"].untyped_storage().data_ptr() != src["view"].untyped_storage().data_ptr()  # type: ignore[union-attr]
    assert packed.large["t"].is_contiguous()
    assert not packed.large["big"].requires_grad
    small = src["small"]
    assert isinstance(small, torch.Tensor)
    small.add_(1)
    assert torch.equal(unpack(packed)["small"], torch.ones(3))  # small tensors are always copied


def test_pack_separate_bytes_threshold() -> None:
    packed = pack({"a": torch.ones(4), "b": torch.ones(2)}, separate_bytes=16)
    assert set(packed.large) == {"a"}
    assert torch.equal(unpack(packed)["b"], torch.ones(2))
    grad_param = torch.nn.Parameter(torch.ones(SEPARATE_BYTES))
    assert not pack({"p": grad_param}, copy=False).large["p"].requires_grad
    with pytest.raises(TypeError, match="mapping"):
        pack([torch.ones(SEPARATE_BYTES)], copy=False)  # type: ignore[arg-type]


def test_model_snapshot_copy_flag() -> None:
    model = Wide()
    shared = model_snapshot(model, copy=False)
    private = model_snapshot(model)
    assert shared.large["fc.weight"].data_ptr() == model.fc.weight.data_ptr()
    assert private.large["fc.weight"].data_ptr() != model.fc.weight.data_ptr()
    assert "fc.bias" not in shared.large


def test_model_server_large_model_push_pull_fake_group(hub3: Hub) -> None:
    PushPullModelServerImpl("server", hub3.group("0"))
    a = hub3.group("1").get_paired("server").to_here()
    b = hub3.group("2").get_paired("server").to_here()
    assert isinstance(a, PushPullModelServer)
    src, dst = Wide(), Wide()
    src.fill(2.0)
    before = len(hub3.calls)
    assert a.push(src) is True
    assert len(hub3.calls) == before + 1
    src.fill(-1.0)
    weight_id = id(dst.fc.weight)
    assert b.pull(dst) is True
    assert dst.values() == [[2.0], [2.0], [2.0]]
    assert id(dst.fc.weight) == weight_id
    stale = Wide()
    assert b.push(stale) is False  # refused: adopts the newest state from the same reply
    assert stale.values() == [[2.0], [2.0], [2.0]]
    assert stale.pp_version == 1


class _KeepAsGiven(OrderedServerBase):
    """A custom in-process ordered server that stores values as given (no copy of its own)."""

    def __init__(self) -> None:
        self.data: dict[object, tuple[object, object]] = {}

    def push(self, key: object, value: object, version: object, prev_version: object) -> bool:
        self.data[key] = (value, version)
        return True

    def pull(self, key: object, version: object = None) -> tuple[object, object] | None:
        return self.data.get(key)


def test_custom_o_server_gets_a_private_copy_of_large_tensors() -> None:
    o = _KeepAsGiven()
    accessor = PushPullModelServer("net", o)
    model = Wide()
    model.fill(5.0)
    assert accessor.push(model)
    model.fill(-5.0)
    fresh = Wide()
    assert accessor.pull(fresh)
    assert fresh.values() == [[5.0], [5.0], [5.0]]
