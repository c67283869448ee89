"""Reusing an opened CUDA share handle: the capability check, the wait for the producer, the reporting.

torch's ``rebuild_cuda_tensor`` reuses a storage this process still holds for the same handle; pc waits for
the producer's event on that path (torch does not) and reports the storages a load opened to a caller that
wants to keep them. Without a GPU the torch side is stood in for by functions with torch's argument layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.multiprocessing import reductions

import pc_pickle
from pc_pickle import _payload, _tensors

_SHARE_CUDA = 2  # the table entry tag of a CUDA share handle


def _fake_rebuild_cuda_tensor(
    tensor_cls: Any,
    tensor_size: Any,
    tensor_stride: Any,
    tensor_offset: Any,
    storage_cls: Any,
    dtype: Any,
    storage_device: Any,
    storage_handle: Any,
    storage_size_bytes: Any,
    storage_offset_bytes: Any,
    requires_grad: Any,
    ref_counter_handle: Any,
    ref_counter_offset: Any,
    event_handle: Any,
    event_sync_required: Any,
) -> torch.Tensor:
    """Stands for torch's rebuild (same parameters): logs the call, returns a CPU uint8 tensor."""
    _calls.append(("rebuild", storage_handle))
    return torch.zeros(storage_size_bytes, dtype=torch.uint8)


def _other_layout(tensor_cls: Any, storage_handle: Any) -> torch.Tensor:
    """A rebuild whose arguments pc does not recognise (a future torch, say)."""
    return torch.zeros(1, dtype=torch.uint8)


_calls: list[tuple[str, Any]] = []  # what the stand-ins were asked to do, in order


class _FakeEvent:
    def __init__(self, device: Any, handle: Any) -> None:
        _calls.append(("open_event", (device, handle)))

    def wait(self, stream: Any) -> None:
        _calls.append(("wait", stream))


def _args(handle: bytes | None = b"h", sync: bool = True, size: int = 8) -> tuple[Any, ...]:
    return (
        torch.Tensor,
        (size,),
        (1,),
        0,
        torch.TypedStorage,
        torch.uint8,
        0,  # device index
        handle,
        size,
        64,  # offset of the storage in its allocation
        False,
        b"ref",
        0,
        b"event",
        sync,
    )


@pytest.fixture
def fake_torch(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[tuple[Any, Any]]]:
    """Stand torch's CUDA rebuild, handle cache, events and streams in; yield the set of cached keys."""
    cached: set[tuple[Any, Any]] = set()

    def lookup(cls: Any, key: tuple[Any, Any]) -> object | None:
        _calls.append(("lookup", key))
        return object() if key in cached else None

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", _fake_rebuild_cuda_tensor)
    monkeypatch.setattr(reductions, "storage_from_cache", lookup)
    monkeypatch.setattr(_tensors, "rebuild_cuda_event", _FakeEvent)
    monkeypatch.setattr(_tensors, "_check_device", torch.device)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: ("stream", device))
    _tensors.cuda_reuse_supported.cache_clear()
    _calls.clear()
    yield cached
    _tensors.cuda_reuse_supported.cache_clear()
    _calls.clear()


def _materialize(rebuild: Any, args: tuple[Any, ...], into: list[Any] | None) -> torch.UntypedStorage:
    with _tensors.reporting_opened_cuda(into):
        return _tensors.materialize_entry((_SHARE_CUDA, "cuda:0", rebuild, args))


# ------------------------------------------------------------------------------------------------------------
# The capability check
# ------------------------------------------------------------------------------------------------------------
def test_cuda_reuse_supported_recognises_this_torch() -> None:
    # Every supported torch has this layout; a release that changes it must fail here, loudly.
    _tensors.cuda_reuse_supported.cache_clear()
    assert _tensors.cuda_reuse_supported()


def test_cuda_reuse_unsupported_for_another_layout_or_no_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        monkeypatch.setattr(reductions, "rebuild_cuda_tensor", _other_layout)
        _tensors.cuda_reuse_supported.cache_clear()
        assert not _tensors.cuda_reuse_supported()
        monkeypatch.undo()
        monkeypatch.delattr(reductions, "storage_from_cache")
        _tensors.cuda_reuse_supported.cache_clear()
        assert not _tensors.cuda_reuse_supported()
    finally:
        monkeypatch.undo()
        _tensors.cuda_reuse_supported.cache_clear()
    assert _tensors.cuda_reuse_supported()


# ------------------------------------------------------------------------------------------------------------
# Opening a handle
# ------------------------------------------------------------------------------------------------------------
def test_cuda_handle_opened_afresh_waits_for_nothing_more_and_is_reported(fake_torch: set[Any]) -> None:
    opened: list[Any] = []
    storage = _materialize(_fake_rebuild_cuda_tensor, _args(), opened)
    assert _calls == [("lookup", (b"h", 64)), ("rebuild", b"h")]  # the rebuild itself waits on a fresh open
    assert storage.nbytes() == 8
    assert len(opened) == 1
    assert opened[0] is storage


def test_cuda_handle_reused_waits_for_the_producer_first(fake_torch: set[Any]) -> None:
    fake_torch.add((b"h", 64))
    opened: list[Any] = []
    storage = _materialize(_fake_rebuild_cuda_tensor, _args(), opened)
    cuda0 = torch.device("cuda", 0)
    # Waited for on the device's current stream, before torch gives the producer's reference back.
    expected = [("lookup", (b"h", 64)), ("open_event", (cuda0, b"event")), ("wait", ("stream", cuda0))]
    assert _calls == [*expected, ("rebuild", b"h")]
    assert len(opened) == 1
    assert opened[0] is storage


def test_cuda_handle_reused_without_a_producer_event(fake_torch: set[Any]) -> None:
    fake_torch.add((b"h", 64))
    _materialize(_fake_rebuild_cuda_tensor, _args(sync=False), None)  # the producer synchronised instead
    assert _calls == [("lookup", (b"h", 64)), ("rebuild", b"h")]


def test_cuda_empty_storage_is_not_looked_up(fake_torch: set[Any]) -> None:
    _materialize(_fake_rebuild_cuda_tensor, _args(handle=None, size=0), None)
    assert _calls == [("rebuild", None)]


def test_cuda_handle_of_an_unrecognised_torch_is_opened_as_before(
    fake_torch: set[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_torch.add((b"h", 64))
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", _other_layout)
    _tensors.cuda_reuse_supported.cache_clear()
    opened: list[Any] = []
    _materialize(_other_layout, (torch.Tensor, b"h"), opened)
    assert _calls == []  # no lookup, no wait
    assert opened == []  # and nothing to keep: holding it could not be made safe


def test_cuda_storages_are_reported_only_while_asked(fake_torch: set[Any]) -> None:
    _materialize(_fake_rebuild_cuda_tensor, _args(), None)  # nobody asked: nothing to report to
    outer: list[Any] = []
    with _tensors.reporting_opened_cuda(outer):
        inner = _materialize(_fake_rebuild_cuda_tensor, _args(b"i"), None)  # a nested load reports nothing
        entry = (_SHARE_CUDA, "cuda:0", _fake_rebuild_cuda_tensor, _args())
        outer_storage = _tensors.materialize_entry(entry)
    assert len(outer) == 1
    assert outer[0] is outer_storage
    assert inner is not outer_storage


# ------------------------------------------------------------------------------------------------------------
# loads and release
# ------------------------------------------------------------------------------------------------------------
def test_loads_reports_into_opened_cuda_and_release_never(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    real = _payload.materialize_entry

    def spy(entry: tuple[Any, ...]) -> torch.UntypedStorage:
        seen.append(getattr(_tensors._local, "opened_cuda", None))
        return real(entry)

    monkeypatch.setattr(_payload, "materialize_entry", spy)
    payload = pc_pickle.dumps(torch.arange(3.0))
    opened: list[Any] = []
    assert torch.equal(pc_pickle.loads(payload, opened_cuda=opened), torch.arange(3.0))
    assert pc_pickle.loads(payload).tolist() == [0.0, 1.0, 2.0]
    with _tensors.reporting_opened_cuda(opened):
        pc_pickle.release(pc_pickle.dumps(torch.ones(2), copy_tensor=False))
    assert seen[0] is opened  # the load's storages go to the caller's list...
    assert seen[1:] == [None, None]  # ...a load without one, and a release, report nowhere
    assert opened == []  # CPU storages are never reported
