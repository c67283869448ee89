"""The guard of calls that one thread of a process must issue at a time (collectives, barriers, DP steps)."""

from __future__ import annotations

import threading

import pytest

from pc_distributed._one_thread import OneThreadAtATime

_T = 30.0


def test_a_second_thread_is_refused_while_the_first_is_inside_and_both_are_named() -> None:
    guard = OneThreadAtATime("collective group [0, 1]")
    inside, release = threading.Event(), threading.Event()
    done: list[str] = []

    def first() -> None:
        with guard("all_reduce"):
            inside.set()
            assert release.wait(_T)
        done.append("first")

    holder = threading.Thread(target=first, name="trainer")
    holder.start()
    assert inside.wait(_T)
    with pytest.raises(RuntimeError) as info, guard("barrier"):
        pass  # pragma: no cover - refused before the body
    message = str(info.value)
    assert "collective group [0, 1]: barrier() called from thread 'MainThread'" in message
    assert "thread 'trainer' is inside all_reduce()" in message
    release.set()
    holder.join(_T)
    assert done == ["first"]  # the holder was not disturbed
    with guard("barrier"):  # free again once it left
        pass


def test_the_same_thread_may_nest_and_threads_may_take_turns() -> None:
    guard = OneThreadAtATime("DASO")
    with guard("step"), guard("all_reduce"):  # a guarded call made from inside another one
        pass
    turns: list[str] = []

    def turn(name: str) -> None:
        with guard("step"):
            turns.append(name)

    for name in ("a", "b", "c"):  # one after the other from different threads: never refused
        worker = threading.Thread(target=turn, args=(name,))
        worker.start()
        worker.join(_T)
    assert turns == ["a", "b", "c"]


def test_the_guard_is_released_when_the_call_raises() -> None:
    guard = OneThreadAtATime("DataParallel")
    with pytest.raises(ValueError, match="boom"), guard("forward"):
        raise ValueError("boom")
    errors: list[BaseException] = []

    def other() -> None:
        try:
            with guard("forward"):
                pass
        except BaseException as exc:  # pragma: no cover - only on failure
            errors.append(exc)

    worker = threading.Thread(target=other)
    worker.start()
    worker.join(_T)
    assert errors == []


@pytest.mark.parametrize("owner", ["CollectiveGroup", "DataParallel", "DASO", "RpcGroup", "World"])
def test_each_single_thread_object_holds_a_guard(owner: str) -> None:
    # The guard is applied where a second thread would corrupt the collective order; its behaviour is tested
    # above and, for a real group of processes, in test_distributed_collective.py.
    import inspect

    import pc_distributed as pd

    source = inspect.getsource(getattr(pd, owner))
    assert "OneThreadAtATime(" in source
