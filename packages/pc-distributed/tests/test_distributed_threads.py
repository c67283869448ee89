"""One thread's blocking wait never stalls another thread's calls in the same process (issue 22).

Each multi-process check follows one protocol, so that the order of events proves the point, not a clock:

    rank 1, thread A: enters the blocking primitive (barrier, group join, World.stop, ...)
    rank 0:           sees A's arrival in the store, then sends rank 1 a "go" RPC
    rank 1, thread B: on "go", makes directory look-ups, claims and service calls, and RPCs the answers to
                      rank 0
    rank 0:           only after those answers arrived does it enter the primitive, which releases A

If B's calls queued behind A's wait, rank 0 would never get the answers (it gives up after ``_T`` seconds), so
the tests would fail. The in-process tests check the same of the store layer and of the tables' lock.
"""

from __future__ import annotations

import tempfile
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from distributed_testutils import fork_unless_cuda

import pc_distributed as pd
from pc_distributed._store import StoreBarrier, StoreClosedError, WaitStores, arrival_key, lookup, wait_keys
from pc_distributed.rpc import _remote
from pc_distributed.rpc._directory import Directory

_T = 30.0  # seconds any one step may take before the check counts as failed (normally milliseconds)
_STEPS = ("barrier", "join", "collective", "stop")
_GO = {step: threading.Event() for step in _STEPS}
_DONE = {step: threading.Event() for step in _STEPS}
_ANSWERS: dict[str, Any] = {}


def _plus_one(x: int) -> int:
    return x + 1


def _go(step: str) -> None:
    _GO[step].set()


def _answers(step: str, answers: Any) -> None:
    _ANSWERS[step] = answers
    _DONE[step].set()


def _peer_lets_through(world: pd.World, group: pd.RpcGroup, step: str, arrival: str) -> tuple[bool, Any]:
    """Rank 0: wait until rank 1's waiting thread arrived, send "go", wait for the answers of its calls."""
    world.store.wait([arrival], timedelta(seconds=_T))
    group.rpc_sync("1", _go, args=(step,))
    return _DONE[step].wait(_T), _ANSWERS.get(step)


def _calls(group: pd.RpcGroup, step: str, claim: bool) -> list[Any]:
    """Rank 1, thread B: an uncached service call (a directory look-up, then one RPC), a look-up, a claim."""
    answers = [group.registered_sync(f"svc_{step}", args=(1,)), group.is_registered(f"svc_{step}")]
    if claim:
        group.pair(f"paired_{step}", step)
        answers.append(group.is_paired(f"paired_{step}"))
    return answers


def _while_waiting(group: pd.RpcGroup, step: str, wait: Any, claim: bool = True) -> dict[str, Any]:
    """Rank 1: run ``wait`` in thread A; on "go", make the calls here and send rank 0 the answers."""
    errors: list[str] = []

    def waiter() -> None:
        try:
            wait()
        except Exception as exc:
            errors.append(repr(exc))

    thread = threading.Thread(target=waiter)
    thread.start()
    answers: Any = None
    if _GO[step].wait(_T):
        try:
            answers = _calls(group, step, claim)
        except Exception as exc:  # reported, so that each step's test fails on its own
            answers = f"calls failed: {exc!r}"
    group.rpc_sync("0", _answers, args=(step, answers))
    thread.join(2 * _T)
    return {"answers": answers, "wait_errors": errors, "wait_returned": not thread.is_alive()}


def _threads_world(rank: int) -> dict[str, Any]:
    world = pd.get_world()
    assert world is not None
    group = world.create_rpc_group("g", ["0", "1"])
    if rank == 0:
        for step in _STEPS:
            group.register(f"svc_{step}", _plus_one)
    group.barrier()  # generation 0: the services exist from here on
    out: dict[str, Any] = {}
    if rank == 0:
        arrival = arrival_key("rg/g/0/bar", 1, "1")
        out["barrier"] = _peer_lets_through(world, group, "barrier", arrival)
        group.barrier(timeout=_T)
        out["join"] = _peer_lets_through(world, group, "join", "rg/h/0/join/1")
        world.create_rpc_group("h", ["0", "1"], timeout=_T)
        seq = world._cg_seq  # both ranks create their collective groups in the same order
        out["collective"] = _peer_lets_through(world, group, "collective", f"cg/{seq}/1")
        world.create_collective_group([0, 1], timeout=_T)
        out["stop"] = _peer_lets_through(world, group, "stop", arrival_key("world/stop", 0, "1"))
        return out  # run_world stops this World, which releases rank 1's stop
    out["barrier"] = _while_waiting(group, "barrier", lambda: group.barrier(timeout=2 * _T))
    out["join"] = _while_waiting(
        group, "join", lambda: world.create_rpc_group("h", ["0", "1"], timeout=2 * _T)
    )
    out["collective"] = _while_waiting(
        group, "collective", lambda: world.create_collective_group([0, 1], timeout=2 * _T)
    )
    # World.stop destroys the live group first; a handle still looks up and calls through the World's store.
    handle = pd.RpcGroup("g", ["0", "1"], first_create=False)
    out["stop"] = _while_waiting(handle, "stop", lambda: world.stop(timeout=2 * _T), claim=False)
    return out


@pytest.fixture(scope="module")
def observed() -> list[dict[str, Any]]:
    return pd.run_world(_threads_world, 2, timeout=300, start_method=fork_unless_cuda())


@pytest.mark.parametrize(
    ("step", "answers"),
    [
        ("barrier", [2, True, True]),
        ("join", [2, True, True]),
        ("collective", [2, True, True]),
        ("stop", [2, True]),
    ],
    ids=["rpc_group_barrier", "create_rpc_group", "create_collective_group", "world_stop"],
)
def test_calls_complete_while_another_thread_waits(
    observed: list[dict[str, Any]], step: str, answers: list[Any]
) -> None:
    arrived, got = observed[0][step]
    assert arrived, f"rank 1's calls did not complete while its other thread waited in {step}"
    assert got == answers
    assert observed[1][step] == {"answers": answers, "wait_errors": [], "wait_returned": True}


# -- the store layer and the tables, in one process ---


@pytest.fixture
def tcp_store() -> Any:
    store = dist.TCPStore(
        "127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=_T), wait_for_workers=False
    )
    yield store
    del store


def test_barrier_wait_leaves_the_shared_client_to_other_threads(tcp_store: Any) -> None:
    shared = dist.PrefixStore("p", tcp_store)
    waits = WaitStores(tcp_store, "p", _T)
    errors: list[BaseException] = []

    def member_a() -> None:
        try:
            StoreBarrier(shared, waits, "bar", "a", ["a", "b"]).enter(0, _T)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=member_a)
    thread.start()
    wait_keys(shared, waits, [arrival_key("bar", 0, "a")], _T, "a's arrival")
    # "a" now waits for "b"; a claim and a look-up on the shared client must still be answered.
    shared.compare_set("dir/k", "", "me")
    seen = lookup(shared, "dir/k")
    assert thread.is_alive()  # "b" has not arrived, so "a" cannot have left the barrier
    StoreBarrier(shared, waits, "bar", "b", ["a", "b"]).enter(0, _T)
    thread.join(_T)
    assert seen == "me"
    assert not thread.is_alive()
    assert errors == []
    assert waits.idle_clients() == 2  # both waits' connections went back to the pool for the next wait
    waits.close()
    assert waits.idle_clients() == 0


def test_a_timed_out_wait_names_the_missing_and_drops_its_connection(tcp_store: Any) -> None:
    shared = dist.PrefixStore("p", tcp_store)
    waits = WaitStores(tcp_store, "p", _T)
    with pytest.raises(TimeoutError, match=r"members that did not arrive: \['b'\]"):
        StoreBarrier(shared, waits, "bar", "a", ["a", "b"]).enter(0, 0.2)
    assert waits.idle_clients() == 0
    waits.close()
    with pytest.raises(StoreClosedError, match="closed"):
        waits.wait(["x"], 1.0)
    with pytest.raises(StoreClosedError):  # not mistaken for a timeout of the barrier
        StoreBarrier(shared, waits, "bar", "a", ["a", "b"]).enter(1, 1.0)


def test_waits_on_a_file_store_use_it_directly() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(str(Path(tmp) / "store"), 1)
        waits = WaitStores(store, "p", _T)
        dist.PrefixStore("p", store).set("k", "1")
        waits.wait(["k"], _T)
        with pytest.raises(RuntimeError):
            waits.wait(["missing"], 0.2)
        assert waits.idle_clients() == 0
        del store


class _HeldStore:
    """A store whose compare_set blocks until released: a claim whose store request is in flight."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self.entered.set()
        if not self.release.wait(_T):
            raise RuntimeError("test store never released")
        return desired.encode()


class _Host:
    """The part of a World a directory uses: its store and its member name."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.name = "me"


def test_a_claim_in_flight_does_not_hold_up_calls_to_other_services() -> None:
    process = _remote.ProcessTables()  # what a World owns
    tables = process.install("threads-claim")
    try:
        tables.services["'ready'"] = _plus_one
        store = _HeldStore()
        claimed: list[BaseException | None] = []

        def register() -> None:
            try:
                Directory(_Host(store), "g").claim(tables, _remote.SERVICE, "'new'", _plus_one, "taken")
                claimed.append(None)
            except BaseException as exc:
                claimed.append(exc)

        thread = threading.Thread(target=register)
        thread.start()
        assert store.entered.wait(_T)
        result: list[Any] = []
        caller = threading.Thread(
            target=lambda: result.append(
                _remote.run_service(process.get("threads-claim"), "'ready'", (1,), {})
            )
        )
        caller.start()
        caller.join(_T)
        answered_while_claiming = not caller.is_alive()
        store.release.set()  # only now may the claim finish
        thread.join(_T)
        caller.join(_T)
        assert answered_while_claiming, "a call to another service waited for the claim's store request"
        assert result == [(_remote.OK, 2)]
        assert claimed == [None]
        assert _remote.run_service(process.get("threads-claim"), "'new'", (2,), {}) == (_remote.OK, 3)
    finally:
        process.drop("threads-claim")


class _ObservedCondition(threading.Condition):
    """A condition that reports when a thread starts waiting on it."""

    def __init__(self, lock: Any) -> None:
        super().__init__(lock)
        self.waiting = threading.Event()

    def wait_for(self, predicate: Any, timeout: float | None = None) -> Any:
        self.waiting.set()
        return super().wait_for(predicate, timeout)


def test_a_call_racing_with_its_keys_claim_is_served_once_the_claim_settles() -> None:
    process = _remote.ProcessTables()  # what a World owns
    tables = process.install("threads-settle")
    try:
        observed = _ObservedCondition(tables.lock)
        tables.settled = observed
        store = _HeldStore()
        registered = threading.Thread(
            target=Directory(_Host(store), "g").claim,
            args=(tables, _remote.SERVICE, "'new'", _plus_one, "taken"),
        )
        registered.start()
        assert store.entered.wait(_T)  # the claim's store request is in flight
        result: list[Any] = []
        caller = threading.Thread(
            target=lambda: result.append(
                _remote.run_service(process.get("threads-settle"), "'new'", (4,), {})
            )
        )
        caller.start()
        assert observed.waiting.wait(_T), "the call did not wait for the claim in flight"
        store.release.set()
        registered.join(_T)
        caller.join(_T)
        assert result == [(_remote.OK, 5)]  # served by the new owner, not "missing"
    finally:
        process.drop("threads-settle")
