"""The c10d transport: RPC frames over gloo links (a group per pair), in real multi-process worlds.

Each test starts one group of processes (c10d_testutils.run_ranks) and runs many checks in it, because a
start costs seconds. Functions sent to other ranks are module-level functions, lambdas and closures (pc-pickle
carries the latter by value); ``_T`` is the transport of the process a function runs in.
"""

from __future__ import annotations

import gc
import os
import pickle
import random
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import psutil
import pytest
import torch
from c10d_testutils import DIED, make_links, run_ranks, stop_process, store_barrier

from pc_distributed._errors import RemoteTraceback
from pc_distributed.rpc._c10d import frames
from pc_distributed.rpc._c10d import transport as transport_module
from pc_distributed.rpc._c10d.calls import PendingCall, PendingCalls
from pc_distributed.rpc._c10d.frames import check_host_tensor
from pc_distributed.rpc._c10d.kept import KeptValues
from pc_distributed.rpc._c10d.transport import C10dTransport
from pc_distributed.rpc._c10d.workers import Workers

_T: C10dTransport | None = None  # the transport of this process (set by each rank's body)
_BLOCK = threading.Event()  # holds _block_until_released until another call sets it


def _transport() -> C10dTransport:
    assert _T is not None
    return _T


def _call_back(origin: int) -> tuple[int, int]:
    """Runs on a peer: calls back into ``origin`` from inside a handler."""
    return os.getpid(), _transport().call_sync(origin, os.getpid, timeout=30)


def _raise_value_error(text: str) -> None:
    raise ValueError(text)


def _return_socket() -> socket.socket:
    return socket.socket()  # closed with the handler's frame when the reply fails to pickle


def _block_until_released() -> str:
    _BLOCK.wait(60)  # stands for a handler that never returns; the test releases it to end cleanly
    return "released"


def _release_block() -> None:
    _BLOCK.set()


def _thread_name() -> str:
    return threading.current_thread().name


def _name_once_released() -> str:
    _BLOCK.wait(60)
    return threading.current_thread().name


def _release_and_name() -> str:
    _BLOCK.set()
    return threading.current_thread().name


def _owned(creator: int, count: int) -> bool:
    return _transport()._wait_owned_count(count, 30, creator)


def _kill_myself() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _c10d_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("pc-c10d")]


@pytest.fixture(autouse=True)
def _no_children_left() -> Any:
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    yield
    left = [
        c
        for c in psutil.Process().children(recursive=True)
        if c.pid not in before and "resource_tracker" not in " ".join(c.cmdline())
    ]
    assert not left, f"processes left behind: {left}"


# -- happy paths --------------------------------------------------------------------------------------------


def _happy(rank: int, t: C10dTransport, store: Any) -> dict[str, Any]:
    global _T
    _T = t
    size = len(t.names)
    peers = [r for r in range(size) if r != rank]
    out: dict[str, Any] = {}
    pids = {r: t.call_sync(r, os.getpid) for r in range(size)}
    out["pids"] = pids

    # lambdas and closures as the function and as arguments; a call to itself runs on a copy
    base = 100 * rank
    out["closures"] = [t.call_sync(p, lambda f, x: f(x), (lambda v: v + base, p)) for p in peers]
    mine = torch.zeros(3)
    copied = t.call_sync(rank, lambda x: x.add_(1), (mine,))
    large = torch.zeros(1 << 15)  # 128 kB: a part of its own, copied too
    large_copied = t.call_sync(rank, lambda x, s: (x.add_(1), s), (large, "tail"))
    out["self_copy"] = (mine.tolist(), copied.tolist())
    out["self_copy_large"] = (float(large.sum()), float(large_copied[0].sum()), large_copied[1])

    # async: futures from every peer, and a then() chain
    futures = [t.call(p, lambda q=p: ("async", q)) for p in peers]
    out["async"] = [f.wait() for f in futures]
    out["then"] = t.call(peers[0], lambda: 20).then(lambda f: f.wait() + 1).wait()

    # many threads at once, every call answered by the right process with its own argument
    errors: list[BaseException] = []
    answers: list[tuple[int, int, int]] = []
    lock = threading.Lock()

    def hammer(seed: int) -> None:
        try:
            for i in range(20):
                target = (seed + i) % size
                got = t.call_sync(target, lambda v: (os.getpid(), v), (seed * 1000 + i,))
                with lock:
                    answers.append((target, got[0], got[1] - seed * 1000 - i))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    out["hammer_errors"] = [repr(e) for e in errors]
    out["hammer"] = (len(answers), all(pids[tr] == pid and d == 0 for tr, pid, d in answers))

    # handlers that call back into their caller, several at once (more than the workers of none)
    backs: list[Any] = []

    def back(p: int) -> None:
        backs.append(t.call_sync(p, _call_back, (rank,), timeout=60))

    threads = [threading.Thread(target=back, args=(peers[i % len(peers)],)) for i in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    out["callbacks"] = sorted(backs)

    # every frame shape: a body too large for the header (both ways), with parts beside it, and parts sent
    # from the caller's memory by call_sync but from a snapshot by call and remote, which return at once
    posted: list[tuple[int, ...]] = []  # the parts' addresses of each request this thread sends
    original = transport_module.post_frame

    me = threading.get_ident()

    def recording(*args: Any, **kwargs: Any) -> Any:
        kind, message = args[2], args[6]
        # this thread's requests: not replies, nor the calls back of handlers the other ranks still run
        if kind in (frames.CALL, frames.REMOTE) and threading.get_ident() == me:
            posted.append(tuple(p.data_ptr() for p in message.parts))
        return original(*args, **kwargs)

    transport_module.post_frame = recording
    try:
        blocks = [torch.full((1 << 15,), float(i)) for i in range(3)]  # 128 kB each: three parts
        text = "x" * 5000  # a head of more than a header holds
        shaped = t.call_sync(peers[0], lambda xs, s: (s * 2, [x + 1 for x in xs]), (blocks, text))
        t.call(peers[0], lambda xs: None, (blocks,)).wait()
        t.remote(peers[0], lambda xs: None, (blocks,)).wait_created()
        sent_sync, sent_async, sent_remote = posted
    finally:
        transport_module.post_frame = original
    mine_ptrs = {b.data_ptr() for b in blocks}
    out["shapes"] = (
        shaped[0] == text * 2,
        all(torch.equal(x, b + 1) for x, b in zip(shaped[1], blocks, strict=True)),
        set(sent_sync) == mine_ptrs,
        len(sent_async) == 3 and not set(sent_async) & mine_ptrs,
        len(sent_remote) == 3 and not set(sent_remote) & mine_ptrs,
    )

    # a 16 MB tensor each way
    big = torch.randn(4 << 20, dtype=torch.float32)
    doubled = t.call_sync(peers[0], lambda x: x * 2, (big,), timeout=120)
    out["big"] = (doubled.shape == big.shape, bool(torch.equal(doubled, big * 2)))

    # remote references: value kept on the owner until released, explicitly or by garbage collection
    owner = peers[0]
    store_barrier(store, "refs", list(range(size)), rank)
    ref = t.remote(owner, lambda: torch.arange(5) + base)
    out["ref_value"] = ref.to_here().tolist()
    out["ref_owner"] = (ref.owner_rank, ref.owner(), ref.is_owner())
    out["ref_kept"] = t.call_sync(owner, _owned, (rank, 1))
    ref.release()
    ref.release()  # idempotent
    out["ref_released"] = t.call_sync(owner, _owned, (rank, 0))  # the release frame went first
    with pytest.raises(KeyError):
        ref.to_here()
    gc_ref = t.remote(owner, lambda: "kept")
    gc_ref.wait_created()
    out["gc_kept"] = t.call_sync(owner, _owned, (rank, 1))
    del gc_ref
    gc.collect()
    out["gc_released"] = t.call_sync(owner, _owned, (rank, 0))
    bad = t.remote(owner, _raise_value_error, ("no value",))
    with pytest.raises(ValueError, match="no value"):
        bad.to_here()
    local = t.remote(rank, lambda: [1, 2])
    out["local_ref"] = (local.to_here(), t.owned_count(rank))
    local.release()
    out["local_released"] = t.owned_count(rank)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(local)
    return out


def test_calls_threads_callbacks_large_payloads_and_remote_refs() -> None:
    results = run_ranks(_happy, 3)
    for rank, out in enumerate(results):
        peers = [r for r in range(3) if r != rank]
        pids = out["pids"]
        assert len(set(pids.values())) == 3
        assert out["closures"] == [p + 100 * rank for p in peers]
        assert out["self_copy"] == ([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])
        assert out["self_copy_large"] == (0.0, float(1 << 15), "tail")
        assert out["async"] == [("async", p) for p in peers]
        assert out["then"] == 21
        assert out["hammer_errors"] == []
        assert out["hammer"] == (160, True)
        assert len(out["callbacks"]) == 6
        assert all(back_pid == pids[rank] for _, back_pid in out["callbacks"])
        assert out["shapes"] == (True, True, True, True, True)
        assert out["big"] == (True, True)
        assert out["ref_value"] == [100 * rank + i for i in range(5)]
        assert out["ref_owner"] == (peers[0], f"w{peers[0]}", False)
        assert out["ref_kept"] is True
        assert out["ref_released"] is True
        assert out["gc_kept"] is True
        assert out["gc_released"] is True
        assert out["local_ref"] == ([1, 2], 1)
        assert out["local_released"] == 0


def _calls_both_ways(rank: int, t: C10dTransport, store: Any) -> list[Any]:
    big = torch.full((1 << 16,), float(rank))  # a part of its own
    return [t.call_sync(p, lambda x, r=rank: (r, float(x.sum())), (big,)) for p in range(3) if p != rank]


def _taking_turns(rank: int, t: C10dTransport, store: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if rank == 0:
        out["one_at_a_time"] = [t.call_sync(1, _thread_name) for _ in range(20)]
        # two at once: the first holds its thread until the second releases it
        held = t.call(1, _name_once_released, timeout=60)
        out["releaser"] = t.call_sync(1, _release_and_name, timeout=60)
        out["held"] = held.wait()
        out["after"] = t.call_sync(1, _thread_name)
        # a request with parts (a 128 kB tensor) is run where it was received too
        block = torch.zeros(1 << 15)
        out["with_parts"] = [t.call_sync(1, lambda x: _thread_name(), (block,)) for _ in range(5)]
    return out


def test_a_request_runs_on_the_receiver_that_took_it_or_on_a_worker_while_the_other_is_busy() -> None:
    # The receiver thread that takes a request runs it (with tensor parts or without), after handing
    # receiving on to the peer's other receiver thread; a request that comes while that one is busy with a
    # request too goes to the worker pool (one worker here). Two requests never run on the two receivers at
    # once: one of them always receives.
    out = run_ranks(_taking_turns, 2, workers=1)[0]
    receivers = {"pc-c10d-recv-1-0-0", "pc-c10d-recv-1-0-1"}
    worker = "pc-c10d-worker-1-0"
    names = out["one_at_a_time"]
    assert set(names) <= receivers | {worker}
    assert any(name in receivers for name in names)  # (all of them, unless a reply outran a thread's return)
    assert {out["held"], out["releaser"]} <= receivers | {worker}
    assert not {out["held"], out["releaser"]} <= receivers
    assert out["after"] in receivers | {worker}
    assert set(out["with_parts"]) <= receivers | {worker}
    assert any(name in receivers for name in out["with_parts"])


_KEPT: list[torch.Tensor] = []  # arguments a handler keeps (the received parts' memory stays theirs)


def _keep_and_add_half(x: torch.Tensor) -> torch.Tensor:
    _KEPT.append(x)
    return x + 0.5


def _kept_then_dropped() -> tuple[list[tuple[float, float]], int]:
    """The kept arguments' smallest and largest values, then the received memory idle once they are freed."""
    seen = [(float(x.min()), float(x.max())) for x in _KEPT]
    _KEPT.clear()
    return seen, _transport()._buffers.idle_bytes()


def _received_memory(rank: int, t: C10dTransport, store: Any) -> dict[str, Any]:
    global _T
    _T = t
    out: dict[str, Any] = {}
    if rank == 0:
        n = 12  # 256 kB each way: parts, whose memory the receiver lends to the tensors it rebuilds
        results = [t.call_sync(1, _keep_and_add_half, (torch.full((1 << 16,), float(i)),)) for i in range(n)]
        out["results"] = [(float(r.min()), float(r.max())) for r in results]
        out["kept"], out["server_idle"] = t.call_sync(1, _kept_then_dropped)
        addresses = {r.data_ptr() for r in results}
        out["idle_while_held"] = t._buffers.idle_bytes()
        del results
        out["idle_once_freed"] = t._buffers.idle_bytes()
        again = [t.call_sync(1, _keep_and_add_half, (torch.full((1 << 16,), -1.0),)) for _ in range(n)]
        out["reused"] = len({r.data_ptr() for r in again} & addresses)
        out["again"] = {(float(r.min()), float(r.max())) for r in again}
        t.call_sync(1, _kept_then_dropped)
    return out


def test_received_tensors_own_their_memory_until_freed_then_it_is_received_into_again() -> None:
    out = run_ranks(_received_memory, 2)[0]
    n, part = 12, 4 << 16
    # neither side lent memory again while a tensor on it lived: every value is the one sent
    assert out["results"] == [(i + 0.5, i + 0.5) for i in range(n)]
    assert out["kept"] == [(float(i), float(i)) for i in range(n)]
    assert out["server_idle"] >= n * part  # what the handler kept came back once it let go of it
    assert out["idle_while_held"] < part
    assert out["idle_once_freed"] >= n * part
    # received into again: all but one, which waits as the receive posted ahead for the next reply
    assert out["reused"] == n - 1
    assert out["again"] == {(-0.5, -0.5)}


def _echo_storages(value: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The tensors as received, and whether each part of the request had a storage of exactly its own."""
    return {"value": value, "own": sorted({t.untyped_storage().nbytes() for t in value.values()})}


def _packed_parts(rank: int, t: C10dTransport, store: Any) -> dict[str, Any]:
    if rank != 0:
        return {}
    torch.manual_seed(1)
    value = {
        "a": torch.randn(25_001),  # four parts under PACK_MAX: one message, each at an aligned offset
        "b": torch.arange(40_000, dtype=torch.int64),
        "c": torch.randn(300_000, dtype=torch.float64),  # alone
        "d": torch.randint(0, 255, (70_001,), dtype=torch.uint8),
        "e": torch.randn(30_000, dtype=torch.float64),
    }
    out = t.call_sync(1, _echo_storages, (value,))
    # compared here: tensors returned to the test's process would travel through torch's shared memory
    return {
        "same": {
            name: (out["value"][name].dtype == x.dtype, torch.equal(out["value"][name], x))
            for name, x in value.items()
        },
        "own": out["own"],
        "sizes": sorted(x.numel() * x.element_size() for x in value.values()),
    }


def test_small_parts_travel_packed_and_arrive_with_storages_of_their_own() -> None:
    out = run_ranks(_packed_parts, 2)[0]
    # there and back: packed by both ends, each tensor equal and of its dtype
    assert out["same"] == dict.fromkeys("abcde", (True, True))
    assert out["own"] == out["sizes"]


def _tagged_echo(tag: int, value: list[torch.Tensor]) -> tuple[int, list[torch.Tensor]]:
    return tag, value


_SHAPES = (  # part sizes in floats: packed, alone, a pack then a large part, under and over the 4 MiB bound
    [25_000] * 4,
    [75_000],
    [25_000, 600_000],
    [1 << 20],
    [(1 << 20) + 1],
)


def _mixed_sizes_from_threads(rank: int, t: C10dTransport, store: Any) -> list[str]:
    """Threads of both ranks call each other with frames whose sizes change from call to call."""
    other = 1 - rank
    failures: list[str] = []

    def caller(seed: int) -> None:
        rng = random.Random(seed)
        for i in range(12):
            shape = _SHAPES[rng.randrange(len(_SHAPES))]
            value = [torch.full((n,), float(seed * 100 + i + k)) for k, n in enumerate(shape)]
            tag, echoed = t.call_sync(other, _tagged_echo, (seed * 100 + i, value), timeout=60)
            if tag != seed * 100 + i or not all(
                torch.equal(a, b) for a, b in zip(echoed, value, strict=True)
            ):
                failures.append(f"rank {rank}, thread {seed}, call {i}: {[x.numel() for x in echoed]}")

    threads = [threading.Thread(target=caller, args=(rank * 10 + k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    failures.extend(f"rank {rank}: a thread still runs" for th in threads if th.is_alive())
    store_barrier(store, "mixed done", [0, 1], rank)
    return failures


def test_frames_of_changing_sizes_from_many_threads_both_ways_all_arrive_intact() -> None:
    # which size waits posted ahead changes with the frames each side sends; every frame must still arrive
    # whole and in the right receive, whatever the threads interleave
    assert run_ranks(_mixed_sizes_from_threads, 2) == [[], []]


def test_links_with_a_device_each_carry_the_same_calls() -> None:
    # a torch without gloo's group options: every link makes its own device (link_devices() is None)
    results = run_ranks(_calls_both_ways, 3, shared_device=False)
    for rank, got in enumerate(results):
        assert got == [(rank, float(rank << 16))] * 2


def _housekeeper_wakes_after_answered_calls(rank: int, t: C10dTransport, store: Any) -> tuple[int, int]:
    """Answered calls with short deadlines, then a quiet window past them: the housekeeper's wakes in it."""
    wakes = []
    expire_due = t._expire_due

    def counting(now: float) -> None:
        wakes.append(now)
        expire_due(now)

    t._expire_due = counting  # type: ignore[method-assign]  # called once per wake of the housekeeper
    answered = 0
    if rank == 0:
        for i in range(40):
            answered += t.call_sync(1, abs, (i,), timeout=0.3) == i
    store_barrier(store, "calls", [0, 1], rank)
    before = len(wakes)
    # an observation window, not a synchronisation: every deadline of the calls above passes within it
    threading.Event().wait(0.8)
    return answered, len(wakes) - before


def test_the_housekeeper_does_not_wake_for_the_deadlines_of_answered_calls() -> None:
    # Keep-alives every 15 s: in the window only a deadline can wake the housekeeper. It may wake once, at
    # the earliest deadline it planned for, and then finds every call answered; it used to wake for the
    # deadline of each answered call in turn (about 40 wakes here).
    results = run_ranks(_housekeeper_wakes_after_answered_calls, 2, link_timeout=60.0)
    answered, wakes = results[0]
    assert answered == 40
    assert wakes <= 2
    assert results[1] == (0, 0)


_STOPPED: dict[str, Any] = {}  # what a handler that shut its own transport down saw
_STOPPED_DONE = threading.Event()


def _shut_down_from_inside() -> str:
    started = time.monotonic()
    try:
        _transport().shutdown(timeout=60)
    except BaseException as exc:  # recorded for the test: it must not happen
        _STOPPED["error"] = repr(exc)
    _STOPPED["after"] = time.monotonic() - started
    _STOPPED["running"] = _transport().is_running
    _STOPPED_DONE.set()
    return "stopped"  # not sent: the goodbye went first


def _stopped_by_a_handler(rank: int, t: C10dTransport, store: Any) -> dict[str, Any]:
    global _T
    _T = t
    store_barrier(store, "up", [0, 1], rank)  # the handler needs rank 1's _T before the call comes
    out: dict[str, Any] = {}
    if rank == 0:
        with pytest.raises(ConnectionError, match="'w1'"):
            t.call_sync(1, _shut_down_from_inside, timeout=60)
        out["running"] = t.is_running
    else:
        out["done"] = _STOPPED_DONE.wait(60)
        out.update(_STOPPED)
        for thread in threading.enumerate():  # the handler's own thread ends once the handler returned
            if thread.name.startswith("pc-c10d"):
                thread.join(30)
        out["threads"] = _c10d_threads()
    return out


def test_a_handler_may_shut_its_own_transport_down() -> None:
    caller, stopped = run_ranks(_stopped_by_a_handler, 2)
    assert caller["running"]  # the caller's transport lives on; only the call to the stopped member failed
    assert stopped["done"]
    assert "error" not in stopped  # it did not try to join its own thread
    assert stopped["after"] < 30  # nor wait half its timeout for its own handler to finish
    assert not stopped["running"]
    assert stopped["threads"] == []


def test_a_worker_may_stop_its_own_pool() -> None:
    pool = Workers(2, "pc-c10d-test-pool")
    seen: dict[str, Any] = {}
    done = threading.Event()

    def stop_it() -> None:
        try:
            seen["still running"] = pool.stop(time.monotonic() + 30)
        except BaseException as exc:  # recorded for the test: it must not happen
            seen["error"] = repr(exc)
        done.set()

    pool.submit(lambda: None)  # another thread of the pool, which stop() does wait for
    pool.submit(stop_it)
    assert done.wait(30)
    assert seen == {"still running": []}
    with pytest.raises(RuntimeError, match="is stopped"):
        pool.submit(lambda: None)
    for thread in threading.enumerate():
        if thread.name.startswith("pc-c10d-test-pool"):
            thread.join(30)  # the one that stopped the pool ends once its callable returned
    assert [t.name for t in threading.enumerate() if t.name.startswith("pc-c10d-test-pool")] == []


def test_pending_calls_give_deadlines_in_order_and_forget_calls_that_ended() -> None:
    calls = PendingCalls()
    made = {
        i: PendingCall(peer=i % 2, call_id=i, deadline=float(d), timeout=1.0, what="call")
        for i, d in [(1, 30), (2, 10), (3, 20), (4, 40)]
    }
    for call in made.values():
        calls.add(call)
    assert len(calls) == 4
    assert calls.next_deadline() == 10.0
    assert calls.pop(2) is made[2]
    assert calls.pop(2) is None  # ended once: whoever popped it ends it
    assert calls.next_deadline() == 20.0  # the ended call's deadline is skipped
    assert calls.to(1) == [made[1], made[3]]
    assert calls.due(25.0) == [made[3]]  # due calls stay in flight until popped
    assert calls.get(3) is made[3]
    assert calls.next_deadline() == 30.0
    assert calls.pop(1) is made[1]
    assert calls.due(100.0) == [made[4]]  # call 1 ended, its deadline is not due any more
    assert calls.next_deadline() is None
    assert calls.pop_all() == [made[3], made[4]]
    assert len(calls) == 0
    assert calls.next_deadline() is None


def test_kept_values_honour_early_releases_failed_creations_and_lost_creators() -> None:
    kept = KeptValues()
    # a release that comes while the value is being created: the value is not kept
    kept.creating((1, 10))
    kept.release((1, 10))
    kept.keep((1, 10), "dropped")
    assert kept.count() == 0
    # a creation that fails forgets its early release: the same key kept later is kept
    kept.creating((1, 11))
    kept.release((1, 11))
    kept.abandon((1, 11))
    kept.keep((1, 11), "kept")
    assert kept.get((1, 11), "value 11") == "kept"
    kept.keep((2, 12), "of two")
    assert (kept.count(), kept.count(1), kept.count(2)) == (2, 1, 1)
    # a lost creator's values go, and none of its values is kept afterwards
    kept.forget(1)
    kept.keep((1, 13), "too late")
    assert (kept.count(1), kept.count(2)) == (0, 1)
    with pytest.raises(KeyError, match="value 11 is released or was never kept"):
        kept.get((1, 11), "value 11")
    # a waiter wakes on the change it waits for, made by other threads
    keys = [(3, i) for i in range(200)]
    writers = [threading.Thread(target=lambda ks=keys[i::4]: [kept.keep(k, k) for k in ks]) for i in range(4)]
    for thread in writers:
        thread.start()
    assert kept.wait_count(200, 30, creator=3)
    for thread in writers:
        thread.join(30)
    releasers = [
        threading.Thread(target=lambda ks=keys[i::4]: [kept.release(k) for k in ks]) for i in range(4)
    ]
    for thread in releasers:
        thread.start()
    assert kept.wait_count(0, 30, creator=3)
    for thread in releasers:
        thread.join(30)
    assert kept.count() == 1
    assert not kept.wait_count(5, 0.01)


# -- failure paths ------------------------------------------------------------------------------------------


def _failures(rank: int, t: C10dTransport, store: Any) -> dict[str, Any]:
    global _T
    _T = t
    other = 1 - rank
    out: dict[str, Any] = {}

    # a remote exception: its type, the remote traceback as __cause__, the member named in a note
    with pytest.raises(ValueError, match="boom") as info:
        t.call_sync(other, _raise_value_error, ("boom",))
    cause = info.value.__cause__
    out["remote_tb"] = (
        isinstance(cause, RemoteTraceback) and "_raise_value_error" in cause.text,
        any(f"w{other}" in n for n in getattr(info.value, "__notes__", [])),
    )
    with pytest.raises(ValueError, match="async boom"):
        t.call(other, _raise_value_error, ("async boom",)).wait()

    # an unpicklable argument fails here, before anything is sent; an unpicklable result fails there
    with socket.socket() as sock, pytest.raises(TypeError, match="cannot be pickled"):
        t.call_sync(other, len, (sock,))
    out["nothing_pending"] = not t._pending  # refused before a call was registered or a frame sent
    with pytest.raises(TypeError, match="cannot be pickled"):
        t.call_sync(other, _return_socket)
    out["after_unpicklable"] = t.call_sync(other, lambda: "fine")

    # a handler that never returns: TimeoutError naming the member, within the call's timeout; the other
    # workers keep serving meanwhile
    store_barrier(store, "block", [0, 1], rank)
    if rank == 0:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="'w1'"):
            t.call_sync(1, _block_until_released, timeout=1.5)
        out["timeout_after"] = time.monotonic() - started
        with pytest.raises(TimeoutError, match="'w1'"):
            t.call(1, _block_until_released, timeout=1.0).wait()
        out["served_meanwhile"] = t.call_sync(1, lambda: "served")
        t.call_sync(1, _release_block)

    # bad arguments: TypeError/ValueError naming them
    with pytest.raises(ValueError, match="to_rank"):
        t.call_sync(2, len, ("x",))
    with pytest.raises(TypeError, match="args"):
        t.call_sync(other, len, "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        t.call_sync(other, len, ("x",), timeout=0)
    with pytest.raises(TypeError, match="kwargs"):
        t.call_sync(other, len, (), kwargs=[1])  # type: ignore[arg-type]

    # the host-tensor guard: never a CUDA (or other device) tensor to gloo
    with pytest.raises(ValueError, match="host memory"):
        check_host_tensor(torch.empty(4, device="meta"), "a frame payload")
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        check_host_tensor(b"bytes", "a frame payload")

    # construction checks, and a second transport on links of its own: shut down twice, then refused
    links = make_links(store, rank, 2, 10, prefix="second")
    with pytest.raises(ValueError, match="a group of two in which this member"):
        C10dTransport({rank: links[other]}, other, ["a", "b"], link_timeout=10)  # the link says: `rank`
    with pytest.raises(ValueError, match="links"):
        C10dTransport(links, rank, ["a", "b", "c"], link_timeout=10)  # no link to the third
    with pytest.raises(ValueError, match="names"):
        C10dTransport(links, rank, ["a", "a"], link_timeout=10)
    with pytest.raises(TypeError, match="process group"):
        C10dTransport({other: object()}, rank, ["a", "b"], link_timeout=10)
    with pytest.raises(TypeError, match="mapping"):
        C10dTransport([links[other]], rank, ["a", "b"], link_timeout=10)  # type: ignore[arg-type]
    second = C10dTransport(links, rank, ["a", "b"], link_timeout=10, timeout=10)
    out["second"] = second.call_sync(other, lambda: "second")
    store_barrier(store, "second", [0, 1], rank)
    second.shutdown(timeout=10)
    second.shutdown(timeout=10)
    with pytest.raises(RuntimeError, match="shut down"):
        second.call_sync(other, len, ("x",))
    out["second_running"] = second.is_running
    return out


def test_remote_errors_unpicklables_timeouts_and_bad_input() -> None:
    results = run_ranks(_failures, 2)
    for out in results:
        assert out["remote_tb"] == (True, True)
        assert out["after_unpicklable"] == "fine"
        assert out["nothing_pending"] is True
        assert out["second"] == "second"
        assert out["second_running"] is False
    # liveness bound, not a speed claim: the call's timeout is 1.5 s
    assert 1.4 <= results[0]["timeout_after"] < 15
    assert results[0]["served_meanwhile"] == "served"


# -- a peer killed ------------------------------------------------------------------------------------------


def _peer_killed(rank: int, t: C10dTransport, store: Any) -> dict[str, Any]:
    global _T
    _T = t
    out: dict[str, Any] = {}
    store_barrier(store, "up", [0, 1, 2], rank)
    if rank == 2:
        store.wait(["kill"], timedelta(seconds=60))
        _kill_myself()
    if rank == 0:
        started = time.monotonic()
        with pytest.raises((ConnectionError, TimeoutError), match="'w2'"):
            t.call_sync(2, _kill_myself, timeout=30)  # dies while serving it
        out["dead_after"] = time.monotonic() - started
        store.set("kill", "1")
        with pytest.raises(ConnectionError, match="'w2'"):
            t.call_sync(2, len, ("x",))
    else:
        store.wait(["kill"], timedelta(seconds=60))
    # the survivors still talk to each other
    out["survivors"] = t.call_sync(1 - rank if rank < 2 else 0, lambda: "alive")
    store_barrier(store, "done", [0, 1], rank)
    started = time.monotonic()
    t.shutdown(timeout=10)
    out["shutdown_after"] = time.monotonic() - started
    out["threads"] = _c10d_threads()
    return out


def test_peer_killed_mid_call_is_named_and_shutdown_stays_bounded() -> None:
    results = run_ranks(_peer_killed, 3, barrier=False, may_die=(2,))
    assert results[2] == DIED
    assert results[0]["dead_after"] < 30  # within the call's timeout
    for out in results[:2]:
        assert out["survivors"] == "alive"
        assert out["shutdown_after"] < 12
        assert out["threads"] == []  # the goodbye of the survivor ended the receiver; the dead one was lost


def _only_peer_killed(rank: int, t: C10dTransport, store: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    store_barrier(store, "up", [0, 1], rank)
    if rank == 1:
        _kill_myself()
    started = time.monotonic()
    # its connection closing ends the receive from it: w1 is lost without a call (a call sent at once could
    # still be served in the moment before the kill; a call to a member dying while serving it is in
    # test_peer_killed_mid_call_is_named_and_shutdown_stays_bounded)
    out["lost"] = t._wait_lost(1, 30)
    out["failed_after"] = time.monotonic() - started
    with pytest.raises(ConnectionError, match="'w1'"):
        t.call_sync(1, os.getpid, timeout=20)
    started = time.monotonic()
    t.shutdown(timeout=3)
    out["shutdown_after"] = time.monotonic() - started
    out["threads"] = _c10d_threads()  # the receive on the dead peer's link ended when its connection closed
    return out


def test_shutdown_with_the_only_peer_dead_is_bounded_and_leaves_no_thread() -> None:
    results = run_ranks(_only_peer_killed, 2, barrier=False, may_die=(1,), link_timeout=6.0)
    assert results[1] == DIED
    out = results[0]
    assert out["lost"] is not None
    assert out["failed_after"] < 30
    assert out["shutdown_after"] < 6
    assert out["threads"] == []


def _all_peers_killed(rank: int, t: C10dTransport, store: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    store_barrier(store, "up", [0, 1, 2], rank)
    if rank > 0:
        _kill_myself()
    for peer in (1, 2):
        out[f"lost {peer}"] = t._wait_lost(peer, 30)  # before the link's timeout (60 s): by the closing
        with pytest.raises(ConnectionError, match=f"'w{peer}'"):
            t.call_sync(peer, os.getpid, timeout=20)
    started = time.monotonic()
    t.shutdown(timeout=3)
    out["shutdown_after"] = time.monotonic() - started
    out["threads"] = _c10d_threads()  # each dead peer's connection closing ended the receive from it
    return out


def test_shutdown_with_every_peer_dead_returns_in_time_and_leaves_no_thread() -> None:
    # a link timeout longer than the test's bounds: nothing may wait for it
    results = run_ranks(_all_peers_killed, 3, barrier=False, may_die=(1, 2), link_timeout=60.0)
    assert results[1:] == [DIED, DIED]
    assert results[0]["lost 1"] is not None
    assert results[0]["lost 2"] is not None
    assert results[0]["shutdown_after"] < 6
    assert results[0]["threads"] == []


def _dies_mid_frame(rank: int, t: C10dTransport, store: Any, missing: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    store_barrier(store, "up", [0, 1, 2], rank)
    if rank == 2:
        # a frame whose 1 MB body, or 1 MB part, never follows: the receiver waits for it from rank 2 only
        header = bytearray(frames.HEADER_BYTES)
        if missing == "body":
            frames._WORDS.pack_into(header, 0, frames._MAGIC, frames.CALL, 2, 999, 0, 1 << 20, 0, 0)
        else:  # the body (inline) announces one part of 1 MB, or two of 100 kB (one pack)
            sizes = [1 << 20] if missing == "part" else [100_000, 100_000]
            body = b"".join(frames._SIZE.pack(size) for size in sizes) + b"R"
            frames._WORDS.pack_into(
                header, 0, frames._MAGIC, frames.CALL, 2, 999, 0, len(body), 1, len(sizes)
            )
            header[frames._WORDS.size : frames._WORDS.size + len(body)] = body
        tensor = torch.frombuffer(header, dtype=torch.uint8)
        link = t._peers[0].link
        link.send([tensor], 0, frames.HEADER_TAG).wait()
        _kill_myself()
    if rank == 0:
        # waited for before calling: a call made first could reach rank 2, and be answered, before it dies
        out["lost"] = t._wait_lost(2, 60)
        with pytest.raises(ConnectionError, match="'w2'"):
            t.call_sync(2, os.getpid, timeout=20)
        store.set("w2 lost", "1")
    store.wait(["w2 lost"], timedelta(seconds=60))
    # the receiver dropped the partial frame and serves the others as before, both ways
    out["after"] = t.call_sync(1 - rank, lambda: "still serving")
    store_barrier(store, "done", [0, 1], rank)
    return out


@pytest.mark.parametrize("missing", ["body", "part", "pack"])
def test_a_peer_dying_mid_frame_is_lost_and_nothing_else_is_affected(missing: str) -> None:
    results = run_ranks(_dies_mid_frame, 3, args=(missing,), barrier=False, may_die=(2,))
    assert results[2] == DIED
    assert "receiving a frame's message from it failed" in results[0]["lost"]
    assert [r["after"] for r in results[:2]] == ["still serving", "still serving"]


# -- a peer stalled ------------------------------------------------------------------------------------------


def _peer_stalled(rank: int, t: C10dTransport, store: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    store.set(f"pid/{rank}", str(os.getpid()))
    store_barrier(store, "up", [0, 1, 2], rank)
    if rank == 2:
        store.wait(["never"], timedelta(seconds=120))  # stopped meanwhile; killed at the end
    if rank == 0:
        stop_process(int(store.get("pid/2")))  # returns once it is stopped, not only signalled
        with pytest.raises(TimeoutError, match="'w2'"):
            t.call_sync(2, os.getpid, timeout=1.0)
        store.set("stopped", "1")
    store.wait(["stopped"], timedelta(seconds=60))
    # the link to the stalled member runs out (4 s without a frame): it is lost, nobody else is
    out["lost"] = t._wait_lost(2, 60)
    with pytest.raises(ConnectionError, match="'w2'"):
        t.call_sync(2, os.getpid)
    out["others"] = t.call_sync(1 - rank, lambda: "still serving")
    store_barrier(store, "done", [0, 1], rank)
    if rank == 0:
        os.kill(int(store.get("pid/2")), signal.SIGKILL)
    started = time.monotonic()
    t.shutdown(timeout=10)
    out["shutdown_after"] = time.monotonic() - started
    return out


def test_a_stalled_peer_times_out_then_is_lost_alone() -> None:
    results = run_ranks(_peer_stalled, 3, barrier=False, may_die=(2,), link_timeout=4.0)
    assert results[2] == DIED
    for out in results[:2]:
        assert out["lost"] is not None
        assert "sent nothing" in out["lost"] or "receiving" in out["lost"]
        assert out["others"] == "still serving"
        assert out["shutdown_after"] < 12
