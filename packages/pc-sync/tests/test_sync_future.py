"""FutureResult: the one-slot hand-over between a master and a slave thread, its timeouts and aborts."""

from __future__ import annotations

import random
import threading
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


def test_future_result_waiter_is_released_only_by_a_value() -> None:
    slot = FutureResult()
    slot.put("a")
    assert slot.get(timeout=1.0) == "a"  # a full put/get cycle leaves nothing behind to release a waiter
    runner = Runner()
    first_done = threading.Event()
    for name in ("g1", "g2"):
        runner.start(name, lambda: (slot.get(timeout=JOIN), first_done.set())[0])
    slot.put("b")
    assert first_done.wait(JOIN)
    assert list(dict(runner.results).values()) == ["b"]  # one value releases one waiter
    slot.put("c")
    runner.join()
    assert not runner.errors
    assert sorted(runner.results.values()) == ["b", "c"]
    with pytest.raises(SyncTimeoutError):  # empty again: a waiter is not released without a value
        slot.get(timeout=0.05)


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


def test_future_result_abort_with_an_unfetched_value_raises_on_every_get() -> None:
    slot = FutureResult()
    slot.put("never read")
    cause = KeyError("gone")
    slot.set_exception(cause)
    for _ in range(3):  # each get raises at once (a waiting get would end in SyncTimeoutError instead)
        with pytest.raises(SyncAbortedError) as info:
            slot.get(timeout=5.0)
        assert info.value.__cause__ is cause


def test_future_result_abort_racing_a_put_and_a_get() -> None:
    # Whatever the interleaving, the waiter gets the value or the abort, and the slot then stays aborted.
    rng = random.Random(0)
    for i in range(200):
        slot = FutureResult()
        runner = Runner()
        runner.start("g", lambda slot=slot: slot.get(timeout=JOIN))
        cause = RuntimeError(f"abort {i}")
        steps = [lambda slot=slot, i=i: slot.put(i), lambda slot=slot, cause=cause: slot.set_exception(cause)]
        rng.shuffle(steps)
        for step in steps:
            step()
        runner.join()
        if "g" in runner.results:
            assert runner.results["g"] == i
        else:
            assert isinstance(runner.errors["g"], SyncAbortedError)
            assert runner.errors["g"].__cause__ is cause
        with pytest.raises(SyncAbortedError):
            slot.get(timeout=5.0)


def test_future_result_takes_a_timeout_beyond_what_a_lock_wait_accepts() -> None:
    # threading.TIMEOUT_MAX is about 9.2e9 s; a longer finite timeout waits that long instead of overflowing
    slot = FutureResult()
    slot.put(1)
    assert slot.get(timeout=1e12) == 1
    runner = Runner()
    runner.start("g", lambda: slot.get(timeout=1e12))
    slot.put(2)
    runner.join()
    assert runner.results == {"g": 2}
