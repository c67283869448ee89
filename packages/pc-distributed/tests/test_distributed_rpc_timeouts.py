"""A call's timeout holds however deep calls nest, on both RPC backends; timeouts past the limit are refused.

**Nested calls.** Member "0" calls "1", which calls "0" back from inside the handler, and so on, 40 deep,
every call with ``timeout=3``: deeper than either backend's pool of handler threads (TensorPipe's 16 per
member, c10d's about 8 workers and 2 receivers per peer). The outermost call must end with ``TimeoutError``
naming the callee and its timeout, whichever way it was made (``rpc_sync``, ``rpc_async(...).wait()``,
``remote(...).to_here()``, ``registered_async(...).wait()``), and the World must work again once the chain
has drained (a plain call succeeds) and stop cleanly. The same for 16 threads each starting a chain 4 deep.
On TensorPipe, torch completes a future (reply or timeout) on the pool the handlers fill, so a wait that is
torch's own never ends.

**Long timeouts.** 30 days and infinity are refused with ``ValueError`` at the call, everywhere a timeout is
taken, on both backends; the longest accepted (``MAX_TIMEOUT``, 24 days) is honoured by a call that returns at
once. torch's TensorPipe agent counts a timeout in 32-bit milliseconds (30 days was an instant timeout) and
c10d's waits overflowed on infinity.

**A filled pool.** Member "1" keeps every handler thread of member "0" busy (calls that wait for an event
of "0"), then "0" calls "1" every way with ``timeout=3``: "1" answers, but on TensorPipe the reply (or torch's
timeout) is completed on "0"'s pool, so each call must end with ``TimeoutError`` at its own deadline, whatever
it waits in (``rpc_sync``, a future's ``wait()``, ``to_here()``); the event is set only after they returned.
c10d receives replies on threads of their own: there the calls succeed.

Each world runs with ``rpc_timeout=30``; the bounds asserted (60 s for a 3 s timeout) are liveness bounds.
"""

from __future__ import annotations

import re
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.rpc as torch_rpc
from distributed_testutils import fork_unless_cuda

import pc_distributed as pd
from pc_distributed._checks import MAX_TIMEOUT, optional_timeout, positive_seconds
from pc_distributed.rpc._tensorpipe import _Deadlines, _Pending

pytestmark = pytest.mark.backends_inside

BACKENDS = ["tensorpipe", "c10d"]
TIMEOUT = 3.0
LIVENESS = 60.0  # seconds an outermost call may take before it counts as hung
DAY = 24 * 3600.0
GROUP = "chain"


def bounce(depth: int, timeout: float) -> str:
    """Call the other member, which calls back, ``depth`` times, each call with ``timeout``."""
    if depth == 0:
        return "bottom"
    world = pd.get_world()
    assert world is not None
    group = world.get_rpc_group(GROUP)
    assert group is not None
    other = "1" if world.name == "0" else "0"
    return str(group.rpc_sync(other, bounce, timeout=timeout, args=(depth - 1, timeout)))


def add(a: int, b: int) -> int:
    return a + b


_HELD = threading.Condition()
_HOLDING = [0]  # handlers of hold() running in this process
_RELEASE = threading.Event()


def hold() -> str:
    """Keep one handler thread of this member busy until the test releases it (or for twice the bound)."""
    with _HELD:
        _HOLDING[0] += 1
        _HELD.notify_all()
    _RELEASE.wait(2 * LIVENESS)
    return "held"


def _outcome(call: Callable[[], Any]) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        value = call()
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "ok", repr(value), time.monotonic() - start


def _outermost(group: Any, how: str, depth: int) -> Callable[[], Any]:
    """The outermost call of a chain ``depth`` deep, made ``how``."""
    args = (depth - 1, TIMEOUT)
    calls: dict[str, Callable[[], Any]] = {
        "rpc_sync": lambda: group.rpc_sync("1", bounce, timeout=TIMEOUT, args=args),
        "rpc_async": lambda: group.rpc_async("1", bounce, timeout=TIMEOUT, args=args).wait(),
        "remote": lambda: group.remote("1", bounce, timeout=TIMEOUT, args=args).to_here(TIMEOUT),
        "registered_async": lambda: group.registered_async("bounce", args=args, timeout=TIMEOUT).wait(),
    }
    return calls[how]


def _at_once(calls: list[Callable[[], Any]]) -> list[tuple[str, str, float] | None]:
    """Each call's outcome, made on threads of their own at once; None: not returned within ``LIVENESS``."""
    results: list[tuple[str, str, float] | None] = [None] * len(calls)

    def one(i: int) -> None:
        results[i] = _outcome(calls[i])

    workers = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(calls))]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + LIVENESS
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
    return results


def _in_threads(group: Any, how: str, threads: int, depth: int) -> list[tuple[str, str, float] | None]:
    return _at_once([_outermost(group, how, depth)] * threads)


def _filled_pool(group: Any, backend: str) -> dict[str, Any]:
    """On member "0", while "1" keeps "0"'s handler threads waiting: "0"'s calls to "1", every way."""
    # TensorPipe: torch's pool (pc keeps its default size); c10d replies never wait for its workers
    target = torch_rpc.TensorPipeRpcBackendOptions().num_worker_threads if backend == "tensorpipe" else 1
    with _HELD:
        filled = _HELD.wait_for(lambda: _HOLDING[0] >= target, timeout=LIVENESS)
    calls: dict[str, Callable[[], Any]] = {
        "rpc_sync": lambda: group.rpc_sync("1", add, timeout=TIMEOUT, args=(2, 3)),
        "rpc_async": lambda: group.rpc_async("1", add, timeout=TIMEOUT, args=(2, 3)).wait(),
        "remote": lambda: group.remote("1", add, timeout=TIMEOUT, args=(2, 3)).to_here(TIMEOUT),
        "registered_async": lambda: group.registered_async("add", args=(2, 3), timeout=TIMEOUT).wait(),
    }
    outcomes = _at_once(list(calls.values()))
    _RELEASE.set()  # only now: on the code before the fix, the calls above waited for this
    return {"filled": filled, **dict(zip(calls, outcomes, strict=True))}


HOLDS = 20  # calls of hold() that member "1" makes: more than TensorPipe's pool of handler threads
SCENARIOS = [
    ("rpc_sync", 1, 40),
    ("rpc_async", 1, 40),
    ("remote", 1, 40),
    ("registered_async", 1, 40),
    ("rpc_sync", 16, 4),
]


def _nested(rank: int, part: str) -> dict[str, Any]:
    """Member ``rank``'s side of the chains (``part="chains"``) or of the filled pool (``"pool"``).

    The two run in worlds of their own: handlers of a chain may still wait for their own calls after the
    chain's outermost call ended, and would hold threads the filled pool's calls expect to find free.
    """
    torch.set_num_threads(1)
    world = pd.get_world()
    assert world is not None
    group = world.create_rpc_group(GROUP, ["0", "1"])
    if rank == 1:
        group.register("bounce", bounce)
        group.register("add", add)
    group.barrier(timeout=30)
    out: dict[str, Any] = {"backend": world.rpc_backend}
    if rank == 0 and part == "chains":
        for how, threads, depth in SCENARIOS:
            label = f"{how} x{threads} depth {depth}"
            out[label] = _in_threads(group, how, threads, depth)
            # once the chain has drained (the handlers' own calls time out too), the World works again
            out[f"{label}: then"] = _outcome(lambda: group.rpc_sync("1", add, timeout=LIVENESS, args=(2, 3)))
    holds = [
        threading.Thread(target=_outcome, args=(lambda: group.rpc_sync("0", hold, timeout=2 * LIVENESS),))
        for _ in range(HOLDS if rank == 1 and part == "pool" else 0)
    ]
    for thread in holds:
        thread.start()
    if rank == 0 and part == "pool":
        out["filled pool"] = _filled_pool(group, world.rpc_backend)
        out["filled pool: then"] = _outcome(lambda: group.rpc_sync("1", add, timeout=LIVENESS, args=(2, 3)))
    for thread in holds:
        thread.join(3 * LIVENESS)
    group.barrier(timeout=LIVENESS * len(SCENARIOS) * 2)
    group.destroy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        world.stop(timeout=30)
    out["stop warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return out


def _world_of(part: str, backend: str) -> dict[str, Any]:
    out = pd.run_world(
        _nested,
        2,
        args=(part,),
        timeout=170,
        start_method=fork_unless_cuda(),
        rpc_timeout=30,
        rpc_backend=backend,
    )
    assert out[1]["backend"] == backend
    assert out[1]["stop warnings"] == []
    return {"backend": backend, **out[0]}


@pytest.fixture(scope="module", params=BACKENDS)
def nested(request: pytest.FixtureRequest) -> dict[str, Any]:
    return _world_of("chains", request.param)


@pytest.fixture(scope="module", params=BACKENDS)
def pool(request: pytest.FixtureRequest) -> dict[str, Any]:
    return _world_of("pool", request.param)


def _is_the_callee_timeout(outcome: tuple[str, str, float] | None) -> bool:
    if outcome is None:
        return False
    kind, text, seconds = outcome
    names_timeout = re.search(rf"\b{TIMEOUT:g} s\b|\b{TIMEOUT * 1000:.0f} ms\b", text) is not None
    # The caller's own deadline, or one of the chain's calls (every call has the same timeout, and the ones
    # started a moment later may end first): a TimeoutError naming a member of the chain either way.
    names_member = "'1'" in text or "'0'" in text
    return kind == "TimeoutError" and names_member and names_timeout and seconds < LIVENESS


@pytest.mark.slow
@pytest.mark.parametrize("how", ["rpc_sync", "rpc_async", "remote", "registered_async"])
def test_a_chain_deeper_than_the_pool_ends_with_the_callers_timeout(nested: dict[str, Any], how: str) -> None:
    label = f"{how} x1 depth 40"
    (outcome,) = nested[label]
    assert _is_the_callee_timeout(outcome), (nested["backend"], outcome)
    assert nested[f"{label}: then"][:2] == ("ok", "5"), nested[f"{label}: then"]


@pytest.mark.slow
def test_threads_each_starting_a_chain_end_in_time(nested: dict[str, Any]) -> None:
    label = "rpc_sync x16 depth 4"
    outcomes = nested[label]
    assert None not in outcomes, (nested["backend"], outcomes)  # every call returned
    for outcome in outcomes:  # each either got through (a free thread) or timed out as the caller asked
        assert outcome[:2] == ("ok", "'bottom'") or _is_the_callee_timeout(outcome), (
            nested["backend"],
            outcome,
        )
    assert nested[f"{label}: then"][:2] == ("ok", "5"), nested[f"{label}: then"]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["rpc_sync", "rpc_async", "remote", "registered_async"])
def test_a_call_ends_at_its_deadline_while_the_callers_pool_is_full(pool: dict[str, Any], how: str) -> None:
    held = pool["filled pool"]
    assert held["filled"], pool["backend"]
    outcome = held[how]
    assert outcome is not None, (pool["backend"], how)  # it returned (before the pool was released)
    if pool["backend"] == "tensorpipe":  # "1" answered, but "0" had no thread to take the reply
        assert _is_the_callee_timeout(outcome), outcome
    else:
        assert outcome[:2] == ("ok", "5"), outcome
    assert pool["filled pool: then"][:2] == ("ok", "5"), pool["filled pool: then"]


@pytest.mark.slow
def test_the_worlds_stop_cleanly_after_the_chains_and_the_filled_pool(
    nested: dict[str, Any], pool: dict[str, Any]
) -> None:
    assert nested["stop warnings"] == []
    assert pool["stop warnings"] == []


# -- long timeouts ------------------------------------------------------------------------------------------


def _refusal(call: Callable[[], Any]) -> str:
    try:
        call()
    except ValueError as exc:
        return "ValueError: " + str(exc)
    except Exception as exc:
        return f"{type(exc).__name__} (not ValueError): {exc}"
    return "accepted"


def _every_way(world: Any, group: Any, ref: Any, seconds: float) -> dict[str, Callable[[], Any]]:
    """Every call of the RPC layer that takes a timeout, with ``seconds``."""
    return {
        "rpc_sync": lambda: group.rpc_sync("1", add, timeout=seconds, args=(1, 2)),
        "rpc_async": lambda: group.rpc_async("1", add, timeout=seconds, args=(1, 2)).wait(),
        "remote": lambda: group.remote("1", add, timeout=seconds, args=(1, 2)).to_here(),
        "to_here": lambda: ref.to_here(timeout=seconds),
        "registered_sync": lambda: group.registered_sync("add", args=(1, 2), timeout=seconds),
        "registered_async": lambda: group.registered_async("add", args=(1, 2), timeout=seconds).wait(),
        "registered_remote": lambda: group.registered_remote("add", args=(1, 2), timeout=seconds),
        "barrier": lambda: group.barrier(timeout=seconds),
        "create_rpc_group": lambda: world.create_rpc_group("other", ["0", "1"], timeout=seconds),
        "stop": lambda: world.stop(timeout=seconds),
    }


def _long_timeouts(rank: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    world = pd.get_world()
    assert world is not None
    group = world.create_rpc_group("long", ["0", "1"])
    if rank == 1:
        group.register("add", add)
    group.barrier(timeout=30)
    out: dict[str, Any] = {}
    if rank == 0:
        ref = group.remote("1", add, args=(1, 1))
        for label, seconds in (("30 days", 30 * DAY), ("inf", float("inf"))):
            ways = _every_way(world, group, ref, seconds)
            out[label] = {way: _refusal(call) for way, call in ways.items()}
        # the longest timeout accepted is honoured (torch's 32-bit milliseconds hold it)
        longest = MAX_TIMEOUT
        out["longest"] = [
            group.rpc_sync("1", add, timeout=longest, args=(1, 2)),
            group.rpc_async("1", add, timeout=longest, args=(2, 2)).wait(),
            group.remote("1", add, timeout=longest, args=(3, 2)).to_here(longest),
            group.registered_sync("add", args=(4, 2), timeout=longest),
            ref.to_here(timeout=longest),
        ]
        if world.rpc_backend == "tensorpipe":  # torch's RRef behind the bounded to_here: its other attributes
            out["forwarded"] = ref.rref.owner_name()
    group.barrier(timeout=30)  # also: a refused stop() stopped nothing
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_timeouts_past_the_limit_are_refused_and_the_limit_is_honoured(backend: str) -> None:
    out, _ = pd.run_world(
        _long_timeouts, 2, timeout=120, start_method=fork_unless_cuda(), rpc_timeout=30, rpc_backend=backend
    )
    for label in ("30 days", "inf"):
        for way, result in out[label].items():
            assert result.startswith(
                "ValueError: timeout must be None (the default) or a positive number of "
                "seconds up to 2073600 (24 days)"
            ), (backend, label, way, result)
    assert out["longest"] == [3, 4, 5, 6, 2]
    assert out.get("forwarded") == ("1" if backend == "tensorpipe" else None)


def test_the_world_and_run_world_refuse_timeouts_past_the_limit() -> None:
    before = pd.get_world()
    for bad in (30 * DAY, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"rpc_timeout must be a positive number of seconds up to"):
            pd.World(name="x", rpc_timeout=bad)
        with pytest.raises(ValueError, match=r"dist_timeout must be a positive number of seconds up to"):
            pd.World(name="x", dist_timeout=bad)
        with pytest.raises(ValueError, match=r"rpc_timeout must be a positive number of seconds up to"):
            pd.run_world(add, 1, rpc_timeout=bad)
    assert pd.get_world() is before  # nothing was started


def test_the_timeout_checks_take_up_to_the_limit_and_refuse_beyond_it() -> None:
    assert optional_timeout("timeout", MAX_TIMEOUT) == MAX_TIMEOUT
    assert optional_timeout("timeout", -1) is None
    assert positive_seconds("rpc_timeout", MAX_TIMEOUT) == MAX_TIMEOUT
    for bad in (MAX_TIMEOUT * 1.0001, 30 * DAY, float("inf"), float("-inf"), float("nan"), 10**400):
        with pytest.raises(
            ValueError, match=r"timeout must be None \(the default\) or .* up to 2073600 \(24 days\)"
        ):
            optional_timeout("timeout", bad)
        with pytest.raises(
            ValueError, match=r"rpc_timeout must be a positive number of seconds up to 2073600"
        ):
            positive_seconds("rpc_timeout", bad)


def _ended(pending: _Pending) -> threading.Event:
    ended = threading.Event()
    pending.future.add_done_callback(lambda _: ended.set())
    return ended


def test_the_deadline_thread_fails_a_pending_future_and_leaves_a_disarmed_one() -> None:
    deadlines = _Deadlines()
    try:
        disarmed, late = _Pending("1", 0.01), _Pending("1", 0.2)
        key = deadlines.arm(time.monotonic() + 0.01, disarmed)
        deadlines.disarm(key)
        ended = _ended(late)
        deadlines.arm(time.monotonic() + 0.2, late)
        assert ended.wait(LIVENESS)
        with pytest.raises(TimeoutError, match=r"no reply from '1' within 0.2 s"):
            late.future.wait()
        assert not disarmed.future.done()  # its deadline came first: had it been armed, it would have failed
        disarmed.settle(value=7)
        assert disarmed.future.wait() == 7
    finally:
        deadlines.close()


def test_closing_the_deadlines_fails_the_calls_still_pending() -> None:
    deadlines = _Deadlines()
    pending = _Pending("1", LIVENESS)
    deadlines.arm(time.monotonic() + LIVENESS, pending)
    deadlines.close()
    assert pending.future.done()
    with pytest.raises(ConnectionError, match="pending when RPC shut down"):
        pending.future.wait()
    after = _Pending("1", LIVENESS)
    deadlines.arm(time.monotonic() + LIVENESS, after)  # armed after close: failed at once
    assert after.future.done()
    with pytest.raises(ConnectionError):
        after.future.wait()


def test_answered_calls_do_not_pile_up_in_the_deadline_heap() -> None:
    deadlines = _Deadlines()
    try:
        for _ in range(10_000):
            deadlines.disarm(deadlines.arm(time.monotonic() + LIVENESS, _Pending("1", LIVENESS)))
        # The compaction's bound with one call armed at a time (2 * 1 + 64); the deadline thread may have
        # dropped more, but its pace is the scheduler's, so only the bound is certain.
        assert len(deadlines._heap) <= 2 * 1 + 64
    finally:
        deadlines.close()
