"""dumps frees everything it made when it returns: no reference cycle keeps the graph or its tensors alive."""

from __future__ import annotations

import gc
import io
import math
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch

import pc_pickle
from pc_pickle import _functions, _pickler, _tensors

pytestmark = pytest.mark.filterwarnings("error")


class _Plain:
    """A weak-referenceable object that goes through reducer_override."""


def _closure_over(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: t


@pytest.fixture
def no_gc() -> Iterator[None]:
    """Turn the cyclic garbage collector off: only reference counting may free what dumps made."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _live_picklers() -> list[object]:
    kinds = (_pickler._GraphPickler, _functions._DillPickler, _tensors.StorageTable)
    return [obj for obj in gc.get_objects() if type(obj) in kinds]


def _dumps_to_file(obj: object, copy_tensor: bool) -> bytes:
    buffer = io.BytesIO()
    pc_pickle.Pickler(buffer, copy_tensor=copy_tensor).dump(obj)
    return buffer.getvalue()


@pytest.mark.parametrize("dump", [pc_pickle.dumps, _dumps_to_file], ids=["dumps", "Pickler"])
@pytest.mark.parametrize("copy_tensor", [True, False], ids=["copy", "share"])
def test_dumps_leaves_no_cycle_behind(no_gc: None, dump: Callable[..., bytes], copy_tensor: bool) -> None:
    big = torch.ones(1_000_000)  # 4 MB: its bytes are a separate piece of the payload
    small = torch.zeros(3)
    plain = _Plain()
    func = _closure_over(small)  # a lambda takes the dill path
    refs = [weakref.ref(x) for x in (big, small, plain, func)]
    data = dump({"big": big, "view": big[10:], "f": func, "o": plain, "mod": math}, copy_tensor=copy_tensor)
    assert _live_picklers() == []  # the picklers and the storage table are gone already
    if not copy_tensor:
        pc_pickle.loads(data)  # share payloads are one-shot: release the handles
    del big, small, plain, func, data
    assert [ref() for ref in refs] == [None] * len(refs)  # refcounting alone freed them


def test_a_copied_storage_buffer_keeps_its_bytes_alive(no_gc: None) -> None:
    """The buffer written for a copied storage owns it: a device->host copy is a temporary nothing else holds.

    (On a GPU, dumps of a CUDA tensor once returned freed host memory: the copy died with the storage table
    before the pieces were joined.)
    """
    storage = torch.arange(4096.0).untyped_storage()
    alive = weakref.ref(storage)
    buffer = _tensors._host_buffer(storage)
    del storage
    assert alive() is not None, "the buffer does not keep the storage it points into alive"
    assert torch.equal(torch.frombuffer(bytearray(buffer.raw()), dtype=torch.float32), torch.arange(4096.0))
    del buffer
    assert alive() is None


def test_a_temporary_host_copy_round_trips(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host bytes from a temporary copy (what a CUDA storage's ``cpu()`` gives) load intact."""
    original = _tensors._host_buffer

    def via_temporary_copy(storage: torch.UntypedStorage) -> object:
        return original(storage.clone())  # like storage.cpu() of a CUDA storage: a copy only the buffer holds

    monkeypatch.setattr(_tensors, "_host_buffer", via_temporary_copy)
    big = torch.randn(300_000)  # > 64 KiB: written as a separate out-of-checksum piece
    small = torch.arange(10.0)
    out = pc_pickle.loads(pc_pickle.dumps({"big": big, "small": small}))
    assert torch.equal(out["big"], big)
    assert torch.equal(out["small"], small)
