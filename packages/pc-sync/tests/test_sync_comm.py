"""SyncMaster / SlavePipe: the thread protocol, its failures, pickling (FutureResult: test_sync_future.py)."""

from __future__ import annotations

import copy
import pickle
import queue
import random
import threading
from collections.abc import Hashable
from typing import Any

import pytest
from sync_threads import JOIN, Runner

from pc_sync import (
    DEFAULT_SYNC_TIMEOUT,
    FutureResult,
    SlavePipe,
    SyncAbortedError,
    SyncError,
    SyncMaster,
    SyncTimeoutError,
)


def _sum_and_route(msgs: list[tuple[Hashable, Any]]) -> list[tuple[Hashable, Any]]:
    """Module-level callback (picklable): everybody gets (own id, total)."""
    total = sum(m for _, m in msgs)
    return [(ident, (ident, total)) for ident, _ in msgs]


# -------------------------------------------------------------------------------------- registration, pipes


def test_slave_pipe_is_the_seed_namedtuple() -> None:
    assert SlavePipe._fields == ("identifier", "queue", "result")
    pipe = SyncMaster(_sum_and_route).register_slave(3)
    assert isinstance(pipe, tuple)
    assert pipe.identifier == 3
    assert isinstance(pipe.result, FutureResult)
    assert DEFAULT_SYNC_TIMEOUT == 300.0


def test_registration_rules() -> None:
    master = SyncMaster(_sum_and_route)
    assert master.nr_slaves == 0
    with pytest.raises(ValueError, match="reserved for the master"):
        master.register_slave(0)
    master.register_slave(1)
    master.register_slave("gpu-2")
    with pytest.raises(ValueError, match="already registered"):
        master.register_slave(1)
    with pytest.raises(TypeError, match="hashable"):
        master.register_slave([1])  # type: ignore[arg-type]
    assert master.nr_slaves == 2
    with pytest.raises(TypeError, match="callable"):
        SyncMaster(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="exception"):
        master.abort("not an exception")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ rounds


def test_round_sees_registration_order_despite_delays_and_routes_replies() -> None:
    seen: list[list[Hashable]] = []

    def callback(msgs: list[tuple[Hashable, Any]]) -> list[tuple[Hashable, Any]]:
        seen.append([ident for ident, _ in msgs])
        # replies for slaves in reverse order: routing is by id, not position
        return [(0, ("master", msgs[0][1]))] + [(ident, (ident, m * 10)) for ident, m in reversed(msgs[1:])]

    master = SyncMaster(callback)
    ids = [5, 2, 9]
    pipes = {i: master.register_slave(i) for i in ids}
    rng = random.Random(0)
    for _ in range(10):
        runner = Runner()
        delays = {i: rng.random() * 0.01 for i in ids}
        for i in ids:
            runner.start(
                i,
                lambda i=i, d=delays[i]: (threading.Event().wait(d), pipes[i].run_slave(i, timeout=JOIN))[1],
            )
        assert master.run_master(-1, timeout=JOIN) == ("master", -1)
        runner.join()
        assert not runner.errors
        assert runner.results == {i: (i, i * 10) for i in ids}
    assert seen == [[0, *ids]] * 10


def test_none_messages_and_replies() -> None:
    master = SyncMaster(lambda msgs: [(ident, None) for ident, _ in msgs])
    pipe = master.register_slave(1)
    runner = Runner()
    runner.start(1, lambda: pipe.run_slave(None, timeout=JOIN))
    assert master.run_master(None, timeout=JOIN) is None
    runner.join()
    assert runner.results == {1: None}


def test_master_without_slaves_runs_callback_alone() -> None:
    master = SyncMaster(_sum_and_route)
    assert master.run_master(7, timeout=1.0) == (0, 7)


def test_thousand_rounds_eight_participants() -> None:
    master = SyncMaster(_sum_and_route)
    n_slaves, rounds = 7, 1000
    pipes = [master.register_slave(i) for i in range(1, n_slaves + 1)]
    expected_total = [r * (n_slaves + 1) + sum(range(n_slaves + 1)) for r in range(rounds)]

    def slave(pipe: SlavePipe) -> bool:
        ident = pipe.identifier
        assert isinstance(ident, int)
        for r in range(rounds):
            assert pipe.run_slave(r + ident, timeout=JOIN) == (ident, expected_total[r])
        return True

    runner = Runner()
    for p in pipes:
        runner.start(p.identifier, lambda p=p: slave(p))
    for r in range(rounds):
        assert master.run_master(r, timeout=JOIN) == (0, expected_total[r])
    runner.join()
    assert not runner.errors
    assert all(runner.results.values())
    assert len(runner.results) == n_slaves


def test_registering_after_a_round_resets_registry() -> None:
    master = SyncMaster(_sum_and_route)
    pipes = [master.register_slave(i) for i in (1, 2, 3)]
    runner = Runner()
    for p in pipes:
        runner.start(p.identifier, lambda p=p: p.run_slave(1, timeout=JOIN))
    assert master.run_master(1, timeout=JOIN) == (0, 4)
    runner.join()
    # fewer slaves next time: the stale ones must not be waited for
    pipe = master.register_slave(1)
    assert master.nr_slaves == 1
    runner = Runner()
    runner.start(1, lambda: pipe.run_slave(5, timeout=JOIN))
    assert master.run_master(1, timeout=5.0) == (0, 6)
    runner.join()
    assert runner.results == {1: (1, 6)}


# ----------------------------------------------------------------------------------------------- failures


def _start_slaves(master: SyncMaster, ids: list[int], timeout: float = JOIN) -> Runner:
    runner = Runner()
    for i in ids:
        pipe = master.register_slave(i)
        runner.start(i, lambda pipe=pipe, i=i: pipe.run_slave(i, timeout=timeout))
    return runner


@pytest.mark.parametrize(
    ("callback", "match"),
    [
        (lambda msgs: [(ident, 0) for ident, _ in reversed(msgs)], "first reply must be for the master"),
        (lambda msgs: [(0, 0), (1, 1)], r"no reply for slave ids \[2\]"),
        (lambda msgs: [(0, 0), (1, 1), (1, 1), (2, 2)], "repeated slave id 1"),
        (lambda msgs: [(0, 0), (1, 1), (7, 2)], "unregistered slave id 7"),
        (lambda msgs: 42, "sequence of \\(identifier, reply\\) pairs"),
        (lambda msgs: [(0, 0), (1, 1), ([2], 2)], r"unregistered slave id \[2\]"),
    ],
)
def test_malformed_replies_raise_and_wake_slaves(callback: Any, match: str) -> None:
    master = SyncMaster(callback)
    runner = _start_slaves(master, [1, 2])
    with pytest.raises(SyncError, match=match) as info:
        master.run_master(0, timeout=JOIN)
    runner.join(5.0)
    assert set(runner.errors) == {1, 2}
    for err in runner.errors.values():
        assert isinstance(err, SyncAbortedError)
        assert err.__cause__ is info.value


def test_callback_error_keeps_its_type_and_reaches_slaves_as_cause() -> None:
    boom = ZeroDivisionError("bad reduction")

    def callback(msgs: list[tuple[Hashable, Any]]) -> list[tuple[Hashable, Any]]:
        raise boom

    master = SyncMaster(callback)
    runner = _start_slaves(master, [1, 2, 3])
    with pytest.raises(ZeroDivisionError, match="bad reduction"):
        master.run_master(0, timeout=JOIN)
    runner.join(5.0)
    assert all(isinstance(e, SyncAbortedError) and e.__cause__ is boom for e in runner.errors.values())
    assert master.aborted
    with pytest.raises(SyncAbortedError):  # the master stays aborted until re-registration
        master.run_master(0, timeout=1.0)


def test_unknown_or_repeated_sender_is_a_protocol_error() -> None:
    master = SyncMaster(_sum_and_route)
    pipe = master.register_slave(1)
    master.register_slave(2)
    pipe.queue.put((99, 0))
    with pytest.raises(SyncError, match="unregistered slave id 99"):
        master.run_master(0, timeout=JOIN)

    master = SyncMaster(_sum_and_route)
    pipe = master.register_slave(1)
    master.register_slave(2)
    pipe.queue.put((1, 0))
    pipe.queue.put((1, 0))
    with pytest.raises(SyncError, match="repeated slave id 1"):
        master.run_master(0, timeout=JOIN)


def test_malformed_queue_items_are_a_protocol_error_on_every_participant() -> None:
    # Only run_slave's own (id, msg) pairs are messages: anything else aborts the round for everybody.
    for bad in [(1, "msg", "extra"), ([1], "msg"), None]:
        master = SyncMaster(_sum_and_route)
        runner = _start_slaves(master, [2])
        master.register_slave(1)  # registered, never sends: only the bad item stands in for it
        master._queue.put(bad)
        with pytest.raises(SyncError, match="unregistered slave id") as info:
            master.run_master(0, timeout=JOIN)
        runner.join(5.0)
        assert isinstance(runner.errors[2], SyncAbortedError)
        assert runner.errors[2].__cause__ is info.value


def test_master_timeout_names_missing_slaves_and_aborts_the_others() -> None:
    master = SyncMaster(_sum_and_route)
    for i in (1, 3):
        master.register_slave(i)
    runner = _start_slaves(master, [2])
    with pytest.raises(SyncTimeoutError, match=r"slaves \[1, 3\]") as info:
        master.run_master(0, timeout=0.3)
    assert info.value.missing == (1, 3)
    assert "equally often" in str(info.value)
    runner.join(5.0)
    err = runner.errors[2]
    assert isinstance(err, SyncAbortedError)
    assert err.__cause__ is info.value


def test_slave_timeout_names_the_master() -> None:
    master = SyncMaster(_sum_and_route)
    pipe = master.register_slave(1)
    with pytest.raises(SyncTimeoutError, match="master") as info:
        pipe.run_slave(0, timeout=0.1)
    assert info.value.missing == (0,)
    assert isinstance(info.value, TimeoutError)
    assert pickle.loads(pickle.dumps(info.value)).missing == (0,)


def test_abort_wakes_every_waiter() -> None:
    # The waiters' timeouts are 60 s: their SyncAbortedError chained to the cause (not SyncTimeoutError)
    # shows the abort released them.
    master = SyncMaster(_sum_and_route)
    for i in (1, 2, 3):
        master.register_slave(i)
    runner = _start_slaves(master, [4, 5], timeout=60.0)
    runner.start(0, lambda: master.run_master(0, timeout=60.0))
    cause = RuntimeError("replica 3 died")
    threading.Timer(0.05, master.abort, args=(cause,)).start()
    runner.join(JOIN)
    assert set(runner.errors) == {0, 4, 5}
    assert all(isinstance(e, SyncAbortedError) and e.__cause__ is cause for e in runner.errors.values())
    master.abort(ValueError("second"))  # idempotent: the first error wins
    with pytest.raises(SyncAbortedError) as info:
        master.run_master(0, timeout=1.0)
    assert info.value.__cause__ is cause


def test_abort_releases_waiters_promptly() -> None:
    master = SyncMaster(_sum_and_route)
    master.register_slave(4)  # never sends: the master keeps waiting
    runner = _start_slaves(master, [1, 2, 3], timeout=60.0)
    ready = threading.Event()
    runner.start(0, lambda: (ready.set(), master.run_master(0, timeout=60.0)))
    assert ready.wait(JOIN)
    master.abort(OSError("gone"))
    runner.join(5.0)  # far below the 60 s timeouts: the abort released them
    assert set(runner.errors) == {0, 1, 2, 3}


def test_registration_after_abort_starts_fresh() -> None:
    master = SyncMaster(_sum_and_route)
    master.register_slave(1)
    master.abort(RuntimeError("x"))
    pipe = master.register_slave(1)
    assert not master.aborted
    runner = Runner()
    runner.start(1, lambda: pipe.run_slave(2, timeout=JOIN))
    assert master.run_master(1, timeout=JOIN) == (0, 3)
    runner.join()


# ----------------------------------------------------------------------------------------------- pickling


class _Holder:
    def __init__(self) -> None:
        self.calls = 0
        self.master = SyncMaster(self.callback)

    def callback(self, msgs: list[tuple[Hashable, Any]]) -> list[tuple[Hashable, Any]]:
        self.calls += 1
        return [(ident, m) for ident, m in msgs]


def test_master_pickles_and_deepcopies() -> None:
    master = SyncMaster(_sum_and_route)
    master.register_slave(1)
    for clone in (pickle.loads(pickle.dumps(master)), copy.deepcopy(master)):
        assert isinstance(clone, SyncMaster)
        assert clone.nr_slaves == 0
        assert clone.run_master(3, timeout=1.0) == (0, 3)


def test_deepcopy_rebinds_bound_callback_to_the_copy() -> None:
    holder = _Holder()
    holder.master.register_slave(1)
    clone = copy.deepcopy(holder)
    assert clone.master is not holder.master
    assert clone.master.run_master("x", timeout=1.0) == "x"
    assert (holder.calls, clone.calls) == (0, 1)
    unpickled = pickle.loads(pickle.dumps(holder))
    unpickled.master.run_master("y", timeout=1.0)
    assert (holder.calls, unpickled.calls) == (0, 1)


def test_queue_type_is_a_simple_queue() -> None:
    pipe = SyncMaster(_sum_and_route).register_slave(1)
    assert isinstance(pipe.queue, queue.SimpleQueue)


# ------------------------------------------------------------------------------------- reuse across rounds


def test_many_rounds_with_varying_slave_counts() -> None:
    # Registering after a round (one without slaves included) starts a fresh registry: every round must wait
    # for exactly the slaves registered for it, route by id and hand the callback a list of its own.
    seen: list[list[tuple[Hashable, Any]]] = []

    def callback(msgs: list[tuple[Hashable, Any]]) -> list[tuple[Hashable, Any]]:
        seen.append(msgs)  # kept: a later round must not change what an earlier one was given
        return _sum_and_route(msgs)

    master = SyncMaster(callback)
    assert master.run_master(5, timeout=1.0) == (0, 5)  # a round without slaves first
    rounds = 30
    for count in (3, 1, 4, 2, 7, 1, 2):
        ids = [10 * count + k for k in range(1, count + 1)]
        pipes = [master.register_slave(i) for i in ids]
        assert master.nr_slaves == count

        def slave(pipe: SlavePipe) -> list[Any]:
            return [pipe.run_slave(r, timeout=JOIN) for r in range(rounds)]

        runner = Runner()
        for p in pipes:
            runner.start(p.identifier, lambda p=p: slave(p))
        start = len(seen)
        for r in range(rounds):
            assert master.run_master(1000 + r, timeout=JOIN) == (0, 1000 + r + r * count)
        runner.join()
        assert not runner.errors
        assert runner.results == {i: [(i, 1000 + r + r * count) for r in range(rounds)] for i in ids}
        for r, msgs in enumerate(seen[start:]):
            assert msgs == [(0, 1000 + r)] + [(i, r) for i in ids]
    assert len({id(msgs) for msgs in seen}) == len(seen)


def test_timeout_names_the_slave_that_skipped_a_round_after_many() -> None:
    master = SyncMaster(_sum_and_route)
    pipes = {i: master.register_slave(i) for i in (1, 2, 3)}
    rounds = 20

    def slave(i: int) -> int:
        done = 0
        for r in range(rounds if i != 2 else rounds - 1):  # slave 2 calls the module once less
            pipes[i].run_slave(r, timeout=JOIN)
            done += 1
        return done

    runner = Runner()
    for i in pipes:
        runner.start(i, lambda i=i: slave(i))
    for r in range(rounds - 1):
        master.run_master(r, timeout=JOIN)
    with pytest.raises(SyncTimeoutError, match=r"slaves \[2\]") as info:
        master.run_master(rounds - 1, timeout=0.5)
    assert info.value.missing == (2,)
    runner.join(5.0)
    assert runner.results == {2: rounds - 1}
    assert set(runner.errors) == {1, 3}
    assert all(isinstance(e, SyncAbortedError) and e.__cause__ is info.value for e in runner.errors.values())


def test_timeouts_beyond_what_a_wait_accepts_still_wait() -> None:
    # threading.TIMEOUT_MAX is about 9.2e9 s: a longer finite timeout waits that long instead of overflowing
    master = SyncMaster(_sum_and_route)
    pipe = master.register_slave(1)
    runner = Runner()
    runner.start(1, lambda: pipe.run_slave(2, timeout=1e12))
    assert master.run_master(1, timeout=1e12) == (0, 3)
    runner.join()
    assert runner.results == {1: (1, 3)}
