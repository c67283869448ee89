"""Pure pieces of the gradient server: packing, reduction arithmetic and the batching queue."""

from __future__ import annotations

import threading

import pytest
import torch

from pc_server._packing import Packed, pack, unpack
from pc_server.errors import ReducerStoppedError
from pc_server.grad._batch_queue import BatchQueue
from pc_server.grad._reduce import Partial, drop_stale, finalize, merge_partials, reduce_pushes

G = {
    "fc1.weight": torch.tensor([[6.0]]),
    "fc2.weight": torch.tensor([[3.0]]),
    "fc3.weight": torch.tensor([[2.0]]),
}


def test_pack_roundtrip_mixed_dtypes_and_extras() -> None:
    src = {
        "a": torch.arange(6.0).reshape(2, 3).t(),  # non-contiguous
        "b": torch.tensor([1, 2], dtype=torch.int64),
        "c": torch.tensor(3.5, dtype=torch.float64),
        "d": torch.zeros(0),
        "extra": {"k": 1},
    }
    packed = pack(src)
    assert set(packed.buffers) == {torch.float32, torch.int64, torch.float64}
    assert packed.numel() == 6 + 2 + 1
    out = unpack(packed)
    assert list(out) == ["a", "b", "c", "d", "extra"]
    for k in "abcd":
        assert out[k].dtype == src[k].dtype
        assert torch.equal(out[k], src[k])
    assert out["extra"] == {"k": 1}
    src["a"].add_(1)
    assert torch.equal(out["a"], torch.arange(6.0).reshape(2, 3).t())  # a copy


def test_pack_errors() -> None:
    with pytest.raises(TypeError, match="mapping"):
        pack([torch.ones(1)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="names must be str"):
        pack({1: torch.ones(1)})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="Packed value"):
        unpack({"a": 1})  # type: ignore[arg-type]
    assert isinstance(pack({}), Packed)


def _sgd(weights: tuple[float, ...], grads: dict[str, torch.Tensor]) -> tuple[float, ...]:
    return tuple(w - grads[f"fc{i + 1}.weight"].item() for i, w in enumerate(weights))


@pytest.mark.parametrize(("method", "expected"), [("sum", (-23.0, -10.0, -5.0)), ("mean", (-5.0, -1.0, 1.0))])
def test_machin_example_two_level_batches(method: str, expected: tuple[float, ...]) -> None:
    # B = 2, one secondary: two secondary batches of two pushes each, one primary batch of two forwards.
    secondary_batches = [reduce_pushes([(0, G), (0, G)]) for _ in range(2)]
    merged = merge_partials(secondary_batches)
    grads, count = finalize(merged, method)
    assert count == 4
    assert _sgd((1.0, 2.0, 3.0), grads) == expected


def test_partial_batch_mean_is_count_weighted() -> None:
    one = {"w": torch.tensor([1.0])}
    two = {"w": torch.tensor([4.0])}
    full = reduce_pushes([(0, one), (0, two)])  # a batch of 2
    partial = reduce_pushes([(0, {"w": torch.tensor([10.0])})])  # flushed alone
    grads, count = finalize(merge_partials([full, partial]), "mean")
    assert count == 3
    assert grads["w"].item() == pytest.approx(5.0)  # (1 + 4 + 10) / 3, not mean of means (2.5+10)/2


def test_groups_by_version_and_drops_stale_exactly() -> None:
    pushes = [(0, {"w": torch.ones(1)}), (3, {"w": torch.ones(1) * 2}), (5, {"w": torch.ones(1) * 4})] * 2
    groups = reduce_pushes(pushes)
    assert {v: g.pushes for v, g in groups.items()} == {0: 2, 3: 2, 5: 2}
    kept, dropped = drop_stale(groups, head=5, max_staleness=2)
    assert set(kept) == {3, 5}
    assert dropped == 2
    kept, dropped = drop_stale(groups, head=5, max_staleness=None)
    assert set(kept) == {0, 3, 5}
    assert dropped == 0
    grads, count = finalize(drop_stale(groups, 5, 2)[0], "sum")
    assert count == 4
    assert grads["w"].item() == 12.0


def test_reduce_rejects_mismatched_names_and_methods() -> None:
    with pytest.raises(ValueError, match="missing \\['b'\\], extra \\['c'\\]"):
        reduce_pushes(
            [(0, {"a": torch.ones(1), "b": torch.ones(1)}), (0, {"a": torch.ones(1), "c": torch.ones(1)})]
        )
    with pytest.raises(ValueError, match="reduce_method must be 'sum' or 'mean', got 'max'"):
        finalize({0: Partial({"a": torch.ones(1)}, 1)}, "max")
    with pytest.raises(ValueError, match="at least one group"):
        finalize({}, "sum")


def test_reduce_refuses_gradients_of_another_shape_instead_of_broadcasting() -> None:
    # (3,) + (1,) broadcasts in add_: the sum of unlike gradients, silently; each secondary checks its pushes
    # against its own first push only, so the primary's merge of two secondaries is where they meet
    with pytest.raises(
        ValueError, match="gradient 'b' has shape \\(1,\\), the first push in the batch \\(3,\\)"
    ):
        reduce_pushes([(0, {"b": torch.ones(3)}), (0, {"b": torch.ones(1)})])
    parts = [{0: Partial({"b": torch.ones(3)}, 1)}, {0: Partial({"b": torch.ones(1)}, 1)}]
    with pytest.raises(ValueError, match="gradient 'b' has shape \\(1,\\)"):
        merge_partials(parts)
    with pytest.raises(ValueError, match="gradient 'b' has shape \\(1,\\)"):
        finalize({0: Partial({"b": torch.ones(3)}, 1), 1: Partial({"b": torch.ones(1)}, 1)}, "sum")


def test_reduce_does_not_modify_inputs() -> None:
    g = {"w": torch.ones(2)}
    groups = reduce_pushes([(0, g), (0, g)])
    finalize(groups, "mean")
    assert torch.equal(g["w"], torch.ones(2))


def test_queue_full_batch_wakes_consumer_promptly() -> None:
    q: BatchQueue[int] = BatchQueue(8)
    got: list[list[int] | None] = []
    done = threading.Event()

    def consumer() -> None:
        got.append(q.get_batch(3, flush_timeout=None))
        done.set()

    t = threading.Thread(target=consumer)
    t.start()
    for i in range(3):
        q.put(i)
    assert done.wait(10), "consumer did not wake on a full batch"
    t.join(10)
    assert got == [[0, 1, 2]]


class _FakeClock:
    """``time.monotonic`` for the queue; its waits advance the clock instead of sleeping, and are recorded."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.waits: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None, "the queue never waits without a bound"
        self.waits.append(timeout)
        self.now += timeout
        return False


def test_queue_partial_flush_after_timeout_and_age(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _FakeClock()
    monkeypatch.setattr("pc_server.grad._batch_queue.time", clock)
    q: BatchQueue[str] = BatchQueue(8)
    monkeypatch.setattr(q._cond, "wait", clock.wait)
    q.put("old", age=200.0)  # already waited longer than the flush timeout elsewhere: due at once
    assert q.get_batch(4, flush_timeout=120.0) == ["old"]
    assert clock.waits == []  # returned without waiting
    q.release()
    q.put("new")
    assert q.get_batch(4, flush_timeout=0.2) == ["new"]
    assert clock.waits == [pytest.approx(0.2)]  # a partial batch waits exactly until its oldest item is due


def test_queue_holds_a_taken_batch_until_released() -> None:
    q: BatchQueue[int] = BatchQueue(8)
    for i in range(3):
        q.put(i)
    assert q.get_batch(2, flush_timeout=None) == [0, 1]
    assert q.pending() == [
        0,
        1,
        2,
    ]  # the taken batch is still the queue's until released (a checkpoint sees it)
    q.release()
    assert q.pending() == [2]
    assert q.get_batch(2, flush_timeout=0.0) == [2]
    q.put(3)
    assert q.drain() == [2, 3]  # after a failure: the held batch and the waiting items
    assert q.pending() == []


def test_queue_overflow_drops_oldest_and_counts(caplog: pytest.LogCaptureFixture) -> None:
    q: BatchQueue[int] = BatchQueue(3, "q")
    for i in range(5):
        q.put(i)
    assert q.dropped == 2
    assert "overflowed max_queue_size=3" in caplog.text
    assert caplog.text.count("overflowed") == 1
    assert q.get_batch(3, None) == [2, 3, 4]


def test_queue_close_drains_then_refuses() -> None:
    q: BatchQueue[int] = BatchQueue(10)
    for i in range(5):
        q.put(i)
    q.close()
    assert q.get_batch(2, None) == [0, 1]
    assert q.get_batch(2, None) == [2, 3]
    assert q.get_batch(2, None) == [4]
    assert q.get_batch(2, None) is None
    with pytest.raises(ReducerStoppedError):
        q.put(9)


def test_queue_close_wakes_idle_consumer() -> None:
    q: BatchQueue[int] = BatchQueue(10)
    result: list[object] = ["unset"]
    t = threading.Thread(target=lambda: result.__setitem__(0, q.get_batch(2, None)))
    t.start()
    q.close()
    t.join(10)
    assert not t.is_alive()
    assert result == [None]
