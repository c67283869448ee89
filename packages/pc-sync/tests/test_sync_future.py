"""FutureResult: the one-slot hand-over between a master and a slave thread, its timeouts and aborts."""

from __future__ import annotations

from typing import Any

import pytest
from sync_threads import JOIN, Runner

from pc_sync import FutureResult, SyncAbortedError, SyncError, SyncMaster, SyncTimeoutError


def test_future_result_keeps_order_and_none_round_trips() -> None:
    slot, ack = FutureResult(), FutureResult()
    values = [None, 1, "two", None, (3,), 0]

    def consume() -> list[Any]:
        got = []
        for _ in values:
            got.append(slot.get(timeout=JOIN))
            ack.put(None)
        return got

    runner = Runner()
    runner.start("c", consume)
    for v in values:
        slot.put(v)
        assert ack.get(timeout=JOIN) is None  # the slot is empty again: reusable
    runner.join()
    assert runner.results["c"] == values


def test_future_result_double_put_raises() -> None:
    slot = FutureResult()
    slot.put(None)
    with pytest.raises(SyncError, match="full slot"):
        slot.put(1)
    assert slot.get(timeout=1.0) is None
    slot.put(2)  # reusable after a get
    assert slot.get(timeout=1.0) == 2


def test_future_result_spurious_notify_does_not_release_waiter() -> None:
    slot = FutureResult()
    runner = Runner()
    runner.start("g", lambda: slot.get(timeout=JOIN))
    for _ in range(20):
        with slot._cond:
            slot._cond.notify_all()
    assert "g" not in runner.results
    assert "g" not in runner.errors
    slot.put("real")
    runner.join()
    assert runner.results == {"g": "real"}


def test_future_result_get_times_out() -> None:
    slot = FutureResult()
    with pytest.raises(SyncTimeoutError) as info:  # nothing is ever put: only the timeout can end the wait
        slot.get(timeout=0.05)
    assert isinstance(info.value, TimeoutError)


def test_future_result_set_exception_wakes_and_sticks() -> None:
    slot = FutureResult()
    runner = Runner()
    runner.start("g", lambda: slot.get(timeout=JOIN))
    cause = KeyError("boom")
    slot.set_exception(cause)
    runner.join(5.0)
    err = runner.errors["g"]
    assert isinstance(err, SyncAbortedError)
    assert err.__cause__ is cause
    slot.put(1)  # dropped: nobody can read it
    with pytest.raises(SyncAbortedError):
        slot.get(timeout=1.0)


@pytest.mark.parametrize(
    ("timeout", "exc"), [(0, ValueError), (-1.0, ValueError), (float("inf"), ValueError)]
)
def test_future_result_rejects_bad_timeouts(timeout: float, exc: type[Exception]) -> None:
    with pytest.raises(exc, match="timeout"):
        FutureResult().get(timeout=timeout)


def test_bad_timeout_types() -> None:
    with pytest.raises(TypeError, match="timeout must be a number"):
        FutureResult().get(timeout="1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="timeout must be a number"):
        SyncMaster(lambda msgs: msgs).run_master(1, timeout=True)
