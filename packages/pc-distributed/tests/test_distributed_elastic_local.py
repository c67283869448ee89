"""ElasticDataParallel in one process: members as threads on one store, the sampler, argument checks.

The members here are threads sharing a ``HashStore`` (gloo groups work between threads of one process), which
tests the protocol (quorums, commits, joins, the minimum, the maximum, leaving) in seconds; killing and
hanging processes is in ``test_distributed_elastic_world.py``.
"""

from __future__ import annotations

import itertools
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed_elastic_testutils import (
    make_model,
    make_optimizer,
    params,
    replay,
    run_threads,
    shard_loss,
)

import pc_distributed as pd
from pc_distributed import _store, _torch_dist
from pc_distributed.parallel.elastic import _connect, _engine

pytestmark = pytest.mark.backends_inside

FAST: dict[str, Any] = {"heartbeat_period": 0.1, "member_timeout": 10.0, "collective_timeout": 4.0}


def _member(store: Any, name: str, steps: int, **kwargs: Any) -> dict[str, Any]:
    model = make_model(name)
    with pd.ElasticDataParallel(
        model, make_optimizer(model), name=name, store=store, **{**FAST, **kwargs}
    ) as edp:
        while edp.step < steps:
            edp.train_step(lambda ctx: shard_loss(model, ctx))
        return {"params": params(model), "log": list(edp.quorum_log), "aborted": edp.aborted_attempts}


def _with_late_joiner(store: Any, name: str, steps: int) -> dict[str, Any]:
    """Members "a" and "b" start the job; "late" joins once a step committed, at step 2 (held for it)."""
    job_keys = _store.prefix_store("pc_elastic/default", store)
    if name == "late":
        job_keys.wait(["committed"], timedelta(seconds=60))  # the others have trained at least a step
        return _member(store, name, steps)
    model = make_model(name)
    kwargs = {**FAST, "initial_members": 2}
    with pd.ElasticDataParallel(model, make_optimizer(model), name=name, store=store, **kwargs) as edp:

        def compute(ctx: pd.StepContext) -> int:
            if ctx.step == 2:  # hold step 2 until the late member is at a boundary (enlisted)
                job_keys.wait(["reg/2"], timedelta(seconds=60))
            return shard_loss(model, ctx)

        while edp.step < steps:
            edp.train_step(compute)
        return {"params": params(model), "log": list(edp.quorum_log), "aborted": edp.aborted_attempts}


def _assert_replay(results: dict[str, Any], log: list[Any]) -> None:
    expected = replay(log)
    for name, r in results.items():
        for got, want in zip(r["params"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=f"member {name}")


# -- the sampler ---


def test_sampler_splits_each_step_exactly_and_covers_the_epoch() -> None:
    s = pd.ElasticSampler(10, 4, seed=3)
    assert s.steps_per_epoch == 2
    assert sorted(s.permutation(0)) == list(range(10))
    assert s.permutation(0) != s.permutation(1)  # a new order per epoch
    assert s.permutation(1) == pd.ElasticSampler(10, 4, seed=3).permutation(1)  # a pure function
    assert s.batch(2) == s.permutation(1)[:4]
    assert s.epoch_of(3) == 1
    # 4 samples over 3 members: runs of 2, 1, 1 in name order, whoever asks.
    parts = [s.indices(5, ["c", "a", "b"], m) for m in ("a", "b", "c")]
    assert [len(p) for p in parts] == [2, 1, 1]
    assert [i for part in parts for i in part] == s.batch(5)


@pytest.mark.parametrize("n_members", [1, 2, 3, 5, 7])
def test_sampler_never_repeats_or_skips_within_an_epoch_whatever_the_members(n_members: int) -> None:
    s = pd.ElasticSampler(50, 7, seed=1)
    seen: list[int] = []
    for step in range(s.steps_per_epoch):  # a different quorum every step
        members = [f"m{i}" for i in range((step % n_members) + 1)]
        for m in members:
            seen += s.indices(step, members, m)
    assert len(seen) == len(set(seen)) == s.steps_per_epoch * 7


def test_sampler_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="num_samples"):
        pd.ElasticSampler(3, 4)
    with pytest.raises(TypeError, match="batch_size"):
        pd.ElasticSampler(10, 2.0)  # type: ignore[arg-type]
    s = pd.ElasticSampler(10, 2)
    with pytest.raises(ValueError, match="not one of"):
        s.indices(0, ["a"], "b")
    with pytest.raises(ValueError, match="distinct"):
        s.indices(0, ["a", "a"], "a")


# -- the protocol, members as threads ---


def test_members_train_in_step_and_equal_a_replay_of_their_log() -> None:
    store = dist.HashStore()
    names = ["0", "1", "2"]
    out = run_threads(lambda n: _member(store, n, 6, initial_members=3), names)
    for r in out.values():
        assert not isinstance(r, BaseException), r
    log = out["0"]["log"]
    assert log == [(s, ("0", "1", "2")) for s in range(6)]
    assert all(out[n]["log"] == log for n in names)
    _assert_replay(out, log)


def test_a_member_joining_later_receives_the_state_and_ends_equal() -> None:
    store = dist.HashStore()
    out = run_threads(lambda name: _with_late_joiner(store, name, 8), ["a", "b", "late"])
    for r in out.values():
        assert not isinstance(r, BaseException), r
    late = out["late"]["log"]
    assert late, out
    assert late[0][0] >= 2  # it entered mid-training
    assert all("late" in m for _, m in out["a"]["log"][late[0][0] :])
    _assert_replay(out, out["a"]["log"])


def test_an_aborted_step_restores_the_buffers_a_joiner_received_not_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first step with a joiner receives the state, then aborts: every member re-runs it from the buffers
    the state transfer left (the joiner's own, from before the transfer, would be stale)."""
    store = dist.HashStore()
    real = _torch_dist.group_all_reduce_sum
    failed: list[str] = []

    def fail_once_in_the_first_step_of_three(group: Any, tensor: torch.Tensor, timeout: float) -> None:
        real(group, tensor, timeout)  # every member completes the collective, so nobody waits for a
        if group.size() == 3 and threading.current_thread().name == "member-a" and not failed:
            failed.append("a")
            raise RuntimeError("injected: a's reduction failed after it completed")

    monkeypatch.setattr(_torch_dist, "group_all_reduce_sum", fail_once_in_the_first_step_of_three)

    def body(name: str) -> dict[str, Any]:
        threading.current_thread().name = f"member-{name}"
        return _with_late_joiner(store, name, 5)

    out = run_threads(body, ["a", "b", "late"])
    for r in out.values():
        assert not isinstance(r, BaseException), r
    assert failed == ["a"]
    assert all(out[n]["aborted"] >= 1 for n in ("a", "b", "late")), out  # the joiner's first step
    joined = out["late"]["log"][0][0]
    assert joined >= 1  # it entered after the running statistics had moved from their initial values
    _assert_replay(out, out["a"]["log"])


def test_below_min_members_the_others_fail_with_a_timeout_naming_who_left() -> None:
    store = dist.HashStore()

    def body(name: str) -> Any:
        model = make_model(name)
        kwargs = {**FAST, "min_members": 3, "quorum_timeout": 3.0}
        with pd.ElasticDataParallel(model, make_optimizer(model), name=name, store=store, **kwargs) as edp:

            def compute(ctx: pd.StepContext) -> int:
                if ctx.step == 2 and name == "c":
                    raise KeyError("c fails")
                return shard_loss(model, ctx)

            while edp.step < 6:
                edp.train_step(compute)

    out = run_threads(body, ["a", "b", "c"])
    assert isinstance(out["c"], KeyError)
    for name in ("a", "b"):
        assert isinstance(out[name], TimeoutError), out[name]
        assert "at least 3 members" in str(out[name])
        assert "'c'" in str(out[name])  # named among the dead or left


def test_max_members_leaves_the_extra_member_waiting() -> None:
    store = dist.HashStore()

    def body(name: str) -> Any:
        return _member(store, name, 4, initial_members=2, max_members=2, quorum_timeout=3.0)

    out = run_threads(body, ["a", "b", "c"])
    done = {n: r for n, r in out.items() if not isinstance(r, BaseException)}
    waited = [n for n, r in out.items() if isinstance(r, BaseException)]
    assert len(done) == 2, out
    assert len(waited) == 1
    assert isinstance(out[waited[0]], TimeoutError)  # the job went on without it, then ended
    assert "no live member holds its state" in str(out[waited[0]])
    log = next(iter(done.values()))["log"]
    assert all(len(m) == 2 for _, m in log)
    _assert_replay(done, log)


def test_a_bad_weight_is_named_and_the_member_leaves() -> None:
    store = dist.HashStore()
    model = make_model("x")
    edp = pd.ElasticDataParallel(model, make_optimizer(model), name="x", store=store, **FAST)
    with pytest.raises(ValueError, match="positive weight"):
        edp.train_step(lambda ctx: 0)
    with pytest.raises(RuntimeError, match="closed"):
        edp.train_step(lambda ctx: 1)


def test_a_lost_store_is_a_connection_error() -> None:
    server = _store.master_store("127.0.0.1", 0, 1, 10.0)
    client = _store.tcp_store_client("127.0.0.1", _store.store_port(server), 10.0)
    model = make_model("x")
    edp = pd.ElasticDataParallel(
        model, make_optimizer(model), name="x", store=client, store_timeout=5.0, **FAST
    )
    try:
        edp.train_step(lambda ctx: shard_loss(model, ctx))
        del server  # the store's server goes away
        with pytest.raises((ConnectionError, TimeoutError), match="store"):
            edp.train_step(lambda ctx: shard_loss(model, ctx))
    finally:
        edp.close()


# -- arguments, the store's server, the capability check ---


def test_the_store_must_be_served_by_an_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model("x")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="run under torchrun or run_world"):
        pd.ElasticDataParallel(model, make_optimizer(model), name="x")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(ValueError, match="served by rank 0"):
        pd.ElasticDataParallel(model, make_optimizer(model), name="x")
    with pytest.raises(TypeError, match="store must be"):
        pd.ElasticDataParallel(model, make_optimizer(model), name="x", store="tcp://127.0.0.1:1")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"name": "a/b"}, ValueError, "name"),
        ({"name": "a", "job": ""}, ValueError, "job"),
        ({"name": "a", "min_members": 0}, ValueError, "min_members"),
        ({"name": "a", "min_members": 3, "max_members": 2}, ValueError, "max_members"),
        ({"name": "a", "min_members": 2, "initial_members": 1}, ValueError, "initial_members"),
        ({"name": "a", "heartbeat_period": 1.0, "member_timeout": 1.0}, ValueError, "member_timeout"),
        ({"name": "a", "quorum_timeout": -1}, ValueError, "quorum_timeout"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    model = make_model("x")
    with pytest.raises(error, match=match):
        pd.ElasticDataParallel(model, make_optimizer(model), store=dist.HashStore(), **kwargs)


def test_bad_module_optimizer_and_duplicate_names() -> None:
    model, store = make_model("x"), dist.HashStore()
    with pytest.raises(TypeError, match="module"):
        pd.ElasticDataParallel("m", make_optimizer(model), name="a", store=store)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer"):
        pd.ElasticDataParallel(model, "sgd", name="a", store=store)  # type: ignore[arg-type]
    other = torch.optim.SGD(make_model("y").parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not module's"):
        pd.ElasticDataParallel(model, other, name="a", store=store)
    mixed = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).double())
    with pytest.raises(ValueError, match="one floating dtype"):
        pd.ElasticDataParallel(mixed, torch.optim.SGD(mixed.parameters(), lr=0.1), name="a", store=store)
    first = pd.ElasticDataParallel(model, make_optimizer(model), name="a", store=store, **FAST)
    try:
        with pytest.raises(ValueError, match="already used"):
            pd.ElasticDataParallel(model, make_optimizer(model), name="a", store=store, **FAST)
    finally:
        first.close()
    with pytest.raises(RuntimeError, match="closed"):
        first.train_step(lambda ctx: 1)


def test_groups_need_gloo_both_branches(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _torch_dist.elastic_groups_available()  # this build has gloo
    monkeypatch.setattr(_torch_dist, "_ProcessGroupGloo", None)
    assert not _torch_dist.elastic_groups_available()
    with pytest.raises(RuntimeError, match="no gloo"):
        _torch_dist.quorum_group(dist.HashStore(), "q", 0, 1, 5.0)
    model = make_model("x")
    with pytest.raises(RuntimeError, match="no gloo"):
        pd.ElasticDataParallel(model, make_optimizer(model), name="a", store=dist.HashStore())


def test_quorum_records_round_trip() -> None:
    from pc_distributed.parallel.elastic._quorum import Quorum

    for members, sync in itertools.product([("a",), ("a", "b")], [(), ("b",)]):
        q = Quorum(3, members, 5, "a", sync, 2)
        assert Quorum.from_json(q.to_json()) == q
    assert _connect.connect(dist.HashStore(), "j", 5.0).prefix == "pc_elastic/j"


def _keys_after(steps: int) -> int:
    store = dist.HashStore()
    run_threads(lambda n: _member(store, n, steps, initial_members=2), ["a", "b"])
    return int(store.num_keys())


def test_the_store_keeps_a_bounded_window_of_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    from pc_distributed.parallel.elastic import _quorum

    monkeypatch.setattr(_quorum, "RETAIN", 3)
    short, long = _keys_after(8), _keys_after(28)
    # Without forgetting, every attempt leaves its quorum, decision, ready and done keys (6 for 2 members):
    # 20 more steps would leave 120 more keys. A stray abort may leave a few.
    assert long - short < 20, (short, long)


def test_a_member_whose_attempt_was_forgotten_enters_where_the_others_are(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pc_distributed.parallel.elastic import _quorum
    from pc_distributed.parallel.elastic._membership import Membership

    monkeypatch.setattr(_quorum, "RETAIN", 3)
    stores = _connect.connect(dist.HashStore(), "j", 5.0)
    membership = Membership(stores.beat, "late", 0.05, 0.5)
    rules = _quorum.QuorumRules(min_members=1, initial_members=1, max_members=8, timeout=5.0, period=0.05)
    try:
        membership.claim()
        membership.enlist()
        stores.store.set("latest", "10")  # the others decided attempt 10; attempt 7 and older are forgotten
        with pytest.raises(_quorum.StaleAttempt, match="attempt 7 of elastic member 'late'"):
            _quorum.form_quorum(stores, membership, 7, 4, rules)
        assert not stores.store.check(["q/7"])  # it proposed nothing for the forgotten attempt
        stores.store.set("latest", "9")  # attempt 7 is still in the window: a quorum is formed
        quorum = _quorum.form_quorum(stores, membership, 7, 4, rules)
        assert quorum.members == ("late",)
        assert quorum.attempt == 7
        _quorum.forget(stores.store, 7, ["late"])
        assert not stores.store.check(["q/7"])
        assert not stores.store.check(["ready/7/late"])
    finally:
        membership.stop()
        stores.close()


def test_a_member_silent_at_the_boundary_is_left_out_one_member_timeout_after_its_last_beat() -> None:
    from pc_distributed.parallel.elastic import _quorum
    from pc_distributed.parallel.elastic._membership import Membership

    store = dist.HashStore()
    ours, theirs = _connect.connect(store, "j", 5.0), _connect.connect(store, "j", 5.0)
    me = Membership(ours.beat, "b", 0.05, 0.5)
    ghost = Membership(theirs.beat, "ghost", 0.05, 0.5)  # enlisted, never beats: died right after
    # A wait slice (period) far longer than member_timeout: the boundary must still see the ghost die on time.
    rules = _quorum.QuorumRules(min_members=1, initial_members=1, max_members=8, timeout=60.0, period=30.0)
    try:
        ghost.claim()
        ghost.enlist()
        me.claim()
        me.enlist()
        me.start()
        assert me.until_expiry(["b"]) == float("inf")  # this member never expires for itself
        assert 0.0 < me.until_expiry(["ghost", "b"]) <= 0.5
        started = time.monotonic()
        quorum = _quorum.form_quorum(ours, me, 0, -1, rules)
        waited = time.monotonic() - started
        assert quorum.members == ("b",)
        assert waited < 10.0, waited  # about member_timeout (0.5 s); a whole slice (30 s) before
        assert me.until_expiry(["ghost"]) == float("inf")  # dead now
    finally:
        me.stop()
        ours.close()
        theirs.close()


# -- the NCCL engine's orchestration, on gloo stand-ins ---


class _HungWork:
    """A collective that never completes: its wait returns only when its group is aborted.

    The real gloo collective under it runs to its end first, so that the peers' part completes and no
    thread is ever left inside a gloo collective of a group that was let go (gloo cannot abort one).
    """

    def __init__(self, aborted: threading.Event, inner: Any) -> None:
        self.aborted = aborted
        self.inner = inner

    def wait(self, *args: Any) -> None:
        self.inner.wait()
        if not self.aborted.wait(60):
            raise AssertionError("the hung collective's group was never aborted")
        raise RuntimeError("stand-in: the collective ended by the abort")


class _StandInNcclGroup:
    """An NCCL group for the CPU: a gloo group that counts its aborts, whose all-reduce may hang until one."""

    def __init__(self, inner: Any, hang: bool) -> None:
        self.inner = inner
        self.hang = hang
        self.aborted = threading.Event()
        self.aborts = 0

    def allreduce(self, tensors: list[torch.Tensor]) -> Any:
        work = self.inner.allreduce(tensors)
        return _HungWork(self.aborted, work) if self.hang else work

    def broadcast(self, tensors: list[torch.Tensor], options: Any) -> Any:
        return self.inner.broadcast(tensors, options)

    def abort(self) -> None:
        self.aborts += 1
        self.aborted.set()


def test_the_nccl_engine_aborts_a_hung_reduction_and_the_step_is_rerun(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Member b's first reduction hangs (as NCCL's kernel would for a dead peer): its helper thread is
    abandoned at the collective timeout, the group aborted (which ends the helper's wait), and the step is
    re-run on a new group. Every group the engine made is aborted exactly once (at a failure, a change or
    the close), and the parameters equal the replay."""
    made: list[_StandInNcclGroup] = []

    def stand_in_group(store: Any, prefix: str, rank: int, size: int, timeout: float) -> Any:
        hang = threading.current_thread().name == "member-b" and not any(g.hang for g in made)
        group = _StandInNcclGroup(_torch_dist.quorum_group(store, prefix, rank, size, timeout), hang)
        made.append(group)
        return group

    monkeypatch.setattr(_torch_dist, "nccl_quorum_groups_available", lambda: True)
    monkeypatch.setattr(_torch_dist, "nccl_quorum_group", stand_in_group)
    monkeypatch.setattr(_engine, "NCCL_DEVICE_TYPES", ("cuda", "cpu"))
    store = dist.HashStore()

    def body(name: str) -> dict[str, Any]:
        threading.current_thread().name = f"member-{name}"
        return _member(store, name, 4, initial_members=3, dist_backend="nccl", collective_timeout=3.0)

    out = run_threads(body, ["a", "b", "c"])
    for r in out.values():
        assert not isinstance(r, BaseException), r
    hung = [g for g in made if g.hang]
    assert len(hung) == 1
    assert hung[0].aborted.is_set()
    assert all(out[n]["aborted"] >= 1 for n in "abc"), out
    log = out["a"]["log"]
    assert log == [(s, ("a", "b", "c")) for s in range(4)]
    assert len(made) >= 6  # a group per member for the aborted attempt, and new ones for the re-run
    assert [g.aborts for g in made] == [1] * len(made)
    _assert_replay(out, log)


class _View:
    """A liveness view standing in for ``Membership``: ``live`` is who counts as alive."""

    def __init__(self, live: list[str]) -> None:
        self._live = live
        self.refreshed = 0

    def refresh_registry(self) -> None:
        self.refreshed += 1

    def live(self) -> list[str]:
        return list(self._live)


@pytest.mark.parametrize(
    ("live", "proposed"),
    [
        (["b", "a"], True),  # the same members, all alive (join order differs from name order)
        (["a", "b", "new"], False),  # someone joined and waits to get in
        (["a"], False),  # "b" is dead or left
    ],
)
def test_the_next_quorum_is_decided_with_a_commit_only_when_nothing_changed(
    live: list[str], proposed: bool
) -> None:
    from pc_distributed.parallel.elastic import _quorum

    stores = _connect.connect(dist.HashStore(), "j", 5.0)
    try:
        committed = _quorum.Quorum(4, ("a", "b"), 7, "a", ("b",), 2)
        view = _View(live)
        _quorum.propose_next(stores, view, committed)  # type: ignore[arg-type]
        assert view.refreshed == 1  # a joiner registered since the last beat is seen
        if proposed:
            nxt = _quorum.Quorum.from_json(stores.store.get("q/5"))
            assert nxt == _quorum.Quorum(5, ("a", "b"), 8, "a", (), 2)  # same group, nothing to send
            assert stores.store.get("latest") == b"5"
        else:
            assert not stores.store.check(["q/5"])
            assert not stores.store.check(["latest"])
    finally:
        stores.close()


def test_a_next_quorum_decided_otherwise_is_kept() -> None:
    from pc_distributed.parallel.elastic import _quorum

    stores = _connect.connect(dist.HashStore(), "j", 5.0)
    try:
        other = _quorum.Quorum(5, ("a",), 8, "a", (), 5)
        stores.store.set("q/5", other.to_json())
        _quorum.propose_next(stores, _View(["a", "b"]), _quorum.Quorum(4, ("a", "b"), 7, "a", (), 2))  # type: ignore[arg-type]
        assert _quorum.Quorum.from_json(stores.store.get("q/5")) == other
        assert not stores.store.check(["latest"])
    finally:
        stores.close()


class _CountingWaits:
    def __init__(self, waits: Any) -> None:
        self._waits = waits
        self.calls = 0

    def wait(self, keys: list[str], timeout: float) -> None:
        self.calls += 1
        self._waits.wait(keys, timeout)

    def close(self) -> None:
        self._waits.close()


def test_a_boundary_whose_quorum_is_decided_waits_for_nobody() -> None:
    """With the next quorum decided at the commit, a member goes from its ready key straight to the step:
    no wait for the others' ready keys (they may not be there yet)."""
    from pc_distributed.parallel.elastic import _quorum
    from pc_distributed.parallel.elastic._membership import Membership

    stores = _connect.connect(dist.HashStore(), "j", 5.0)
    membership = Membership(stores.beat, "b", 0.05, 5.0)
    rules = _quorum.QuorumRules(min_members=2, initial_members=2, max_members=8, timeout=30.0, period=5.0)
    decided = _quorum.Quorum(5, ("a", "b"), 8, "a", (), 2)
    try:
        membership.claim()
        membership.enlist()
        stores.store.set("q/5", decided.to_json())
        counting = _CountingWaits(stores.waits)
        stores.waits = counting  # type: ignore[assignment]
        assert _quorum.form_quorum(stores, membership, 5, 8, rules) == decided
        assert counting.calls == 0  # "a" never wrote ready/5: a wait would have lasted 5 s at least
        assert stores.store.get("ready/5/b") == b"8"
    finally:
        membership.stop()
        stores.close()


def test_a_member_leaving_after_a_commit_costs_the_others_one_aborted_attempt() -> None:
    """The next quorum was decided with the commit, so the member that left is in it: the others' reduction
    fails, the attempt is aborted and re-run without it; nothing is applied twice (the replay)."""
    store = dist.HashStore()

    def member(name: str) -> dict[str, Any]:
        steps = 3 if name == "c" else 6
        return _member(store, name, steps, initial_members=3)

    out = run_threads(member, ["a", "b", "c"])
    for r in out.values():
        assert not isinstance(r, BaseException), r
    log = out["a"]["log"]
    assert log == [(s, ("a", "b", "c")) for s in range(3)] + [(s, ("a", "b")) for s in range(3, 6)]
    assert out["b"]["log"] == log
    assert out["a"]["aborted"] <= 1
    assert out["b"]["aborted"] <= 1
    _assert_replay({"a": out["a"], "b": out["b"]}, log)


def test_the_housekeeper_records_the_newest_commit_and_forgets_each_attempt_once() -> None:
    from pc_distributed.parallel.elastic import _quorum
    from pc_distributed.parallel.elastic._housekeeper import Housekeeper

    stores = _connect.connect(dist.HashStore(), "j", 5.0)
    try:
        for a in range(6):
            stores.store.set(f"q/{a}", _quorum.Quorum(a, ("a", "b"), a, "a", (), 0).to_json())
            for n in ("a", "b"):
                stores.store.set(f"ready/{a}/{n}", str(a))
                stores.store.set(f"done/{a}/{n}", "1")
            stores.store.set(f"decide/{a}", "commit")
        last_deleted = threading.Event()

        class _Watched:  # the job's keys; tells when attempt 3's quorum, forgotten last, is deleted
            def __getattr__(self, name: str) -> Any:
                return getattr(stores.chores, name)

            def delete_key(self, key: str) -> bool:
                deleted = stores.chores.delete_key(key)
                if key == "q/3":
                    last_deleted.set()
                return deleted

        keeper = Housekeeper(_Watched(), lambda: ["a", "b"], "b")  # type: ignore[arg-type]
        keeper.record(3, 1)
        keeper.record(4, 3)
        assert last_deleted.wait(30)
        keeper.close(30.0)
        assert keeper.error is None
        assert stores.store.get("committed") == b"4"
        for a in range(6):  # attempts 0-3 forgotten (the first record starts at its own attempt: 1)
            kept = a == 0 or a > 3
            assert stores.store.check([f"q/{a}"]) == kept, a
            assert stores.store.check([f"ready/{a}/b", f"done/{a}/a", f"decide/{a}"]) == kept, a
    finally:
        stores.close()


class _Silent:
    def set(self, key: str, value: str) -> None:
        raise TimeoutError("the store does not answer")


def test_a_housekeeper_whose_store_fails_stops_and_keeps_the_error() -> None:
    from pc_distributed.parallel.elastic._housekeeper import Housekeeper

    keeper = Housekeeper(_Silent(), list, "x")  # type: ignore[arg-type]
    keeper.record(1, -5)
    keeper.close(30.0)
    assert isinstance(keeper.error, TimeoutError)
    assert not keeper._thread.is_alive()


class _Slow:
    """A store whose deletes block until released (a long forget in progress)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.deletes = 0

    def set(self, key: str, value: str) -> None:
        pass

    def check(self, keys: list[str]) -> bool:
        return False

    def delete_key(self, key: str) -> bool:
        self.deletes += 1
        self.release.wait(30)
        return False


def test_closing_a_housekeeper_drops_the_attempts_it_has_not_forgotten() -> None:
    from pc_distributed.parallel.elastic._housekeeper import Housekeeper

    slow = _Slow()
    keeper = Housekeeper(slow, lambda: ["a"], "x")  # type: ignore[arg-type]
    keeper.record(100, 0)  # starts at attempt 0
    keeper.record(101, 50)  # 51 attempts to forget, three deletes each
    keeper.close(0.1)  # the thread is inside a delete: close does not wait for it
    slow.release.set()
    keeper._thread.join(30)
    assert not keeper._thread.is_alive()
    assert slow.deletes <= 6  # the attempt in progress (and at most one more), not all 51
