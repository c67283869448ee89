"""ReplicaThreads: replica threads kept between forwards, their end, and the calls that must not deadlock."""

from __future__ import annotations

import copy
import gc
import multiprocessing
import pickle
import threading
from typing import Any

import pytest
import torch
from torch import nn

from pc_replicate import ReplicationCallbackDataParallel
from pc_replicate._apply import apply_replicas
from pc_replicate._pool import ReplicaThreads, threads_of

JOIN = 30.0  # bound on every join: "ended rather than hung"


class _Recorder(nn.Module):
    """Records the thread each call runs on: the Thread objects themselves, never mistaken for another."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.seen: list[threading.Thread] = []
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.seen.append(threading.current_thread())
        return self.lin(x)


def _recorder_dp(n: int) -> tuple[ReplicationCallbackDataParallel[_Recorder], _Recorder]:
    module = _Recorder()
    return ReplicationCallbackDataParallel(module, device_ids=["cpu"] * n), module


def _forward_threads(dp: nn.Module, module: _Recorder, x: torch.Tensor) -> set[threading.Thread]:
    module.seen.clear()  # CPU replicas share the module's attributes: every replica appends here
    out = dp(x)
    assert out.shape == (x.shape[0], 2)
    return set(module.seen)


def _join_all(threads: set[threading.Thread]) -> list[str]:
    for thread in threads:
        thread.join(JOIN)
    return [t.name for t in threads if t.is_alive()]


def test_forwards_reuse_the_same_replica_threads(no_thread_leak: None) -> None:
    dp, module = _recorder_dp(3)
    x = torch.randn(6, 2)
    seen: set[threading.Thread] = set()
    for _ in range(10):
        seen |= _forward_threads(dp, module, x)
    # A thread per replica per forward would be 30 threads; kept threads are at most one per replica (a
    # replica that ends before the next is handed out may even leave its thread to the next one).
    assert 1 <= len(seen) <= 3
    assert threading.current_thread() not in seen
    assert all(t.name.startswith("pc-replicate-replica-") for t in seen)
    assert threads_of(dp).size == len(seen)
    del dp
    gc.collect()
    assert not _join_all(seen)  # the module's end ends its threads


def test_outputs_and_gradients_match_a_direct_call_over_many_forwards(no_thread_leak: None) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    dp = ReplicationCallbackDataParallel(net, device_ids=["cpu"] * 2)
    for _ in range(5):
        x = torch.randn(6, 4)
        net.zero_grad()
        dp(x).square().sum().backward()
        ours = [p.grad.clone() for p in net.parameters() if p.grad is not None]
        net.zero_grad()
        net(x).square().sum().backward()
        direct = [p.grad for p in net.parameters() if p.grad is not None]
        assert len(ours) == len(direct) == 4
        for a, b in zip(ours, direct, strict=True):
            torch.testing.assert_close(a, b)


def test_a_failed_replica_returns_its_thread_and_the_next_call_works() -> None:
    pool = ReplicaThreads()
    fail = {"on": True}
    ran_on: list[threading.Thread] = []

    class Flaky(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            ran_on.append(threading.current_thread())
            if fail["on"]:
                raise ValueError("replica 1 failed")
            return x + 1

    replicas: list[nn.Module] = [nn.Identity(), Flaky()]
    inputs = [(torch.zeros(1),), (torch.zeros(1),)]
    try:
        with pytest.raises(ValueError, match="replica 1 failed"):
            apply_replicas(replicas, inputs, threads=pool)
        fail["on"] = False
        out = apply_replicas(replicas, inputs, threads=pool)
        assert [float(o) for o in out] == [0.0, 1.0]
        assert ran_on[0].is_alive()  # the failure's thread went back to the pool rather than ending
        assert pool.size <= 2
    finally:
        pool.close()


def test_a_task_that_leaks_grad_mode_ends_its_thread() -> None:
    pool = ReplicaThreads()
    seen: list[threading.Thread] = []
    leak = {"on": True}

    class Leaky(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(threading.current_thread())
            if leak["on"]:
                torch.set_grad_enabled(False)  # never restored: the thread's state is no longer fresh
            return x * 2

    replicas: list[nn.Module] = [Leaky(), Leaky()]
    x = torch.ones(1, requires_grad=True)
    try:
        apply_replicas(replicas, [(x,), (x,)], threads=pool)
        leaked = set(seen)
        assert not _join_all(leaked)  # a thread with a changed state is not kept
        leak["on"] = False
        seen.clear()
        out = apply_replicas(replicas, [(x,), (x,)], threads=pool)
        assert all(o.requires_grad for o in out)  # the caller's grad mode, not the leaked one
        assert not set(seen) & leaked
        assert 1 <= pool.size <= 2
    finally:
        pool.close()


def _nested_forward(pool: ReplicaThreads) -> list[Any]:
    class Outer(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            inner = apply_replicas([nn.Identity(), nn.Identity()], [(x,), (x + 1,)], threads=pool)
            return inner[0] + inner[1]

    return apply_replicas([Outer(), Outer()], [(torch.zeros(1),), (torch.ones(1),)], threads=pool)


def test_nested_and_concurrent_calls_on_one_pool_do_not_wait_for_each_other() -> None:
    pool = ReplicaThreads()
    results: dict[int, list[float]] = {}

    def caller(i: int) -> None:
        results[i] = [float(t) for t in _nested_forward(pool)]

    callers = [threading.Thread(target=caller, args=(i,)) for i in range(3)]
    try:
        for t in callers:
            t.start()
        for t in callers:
            t.join(JOIN)
        assert not any(t.is_alive() for t in callers), "a nested or concurrent call waited for a busy thread"
        assert results == {i: [1.0, 3.0] for i in range(3)}
    finally:
        pool.close()


def _child_apply(pool: ReplicaThreads, out: Any) -> None:
    out.put([float(t) for t in apply_replicas([nn.Identity()] * 2, [(torch.ones(1),)] * 2, threads=pool)])


def test_a_forked_child_starts_its_own_threads() -> None:
    pool = ReplicaThreads()
    apply_replicas([nn.Identity()] * 2, [(torch.zeros(1),)] * 2, threads=pool)  # the parent's threads
    ctx = multiprocessing.get_context("fork")
    out = ctx.SimpleQueue()
    child = ctx.Process(target=_child_apply, args=(pool, out))
    child.start()
    try:
        child.join(JOIN)
        assert child.exitcode == 0, "the child hung or failed on the parent's (absent) threads"
        assert out.get() == [1.0, 1.0]
    finally:
        if child.is_alive():
            child.kill()
            child.join(JOIN)
        out.close()
        pool.close()


def test_a_closed_pool_refuses_work_and_its_threads_end() -> None:
    pool = ReplicaThreads()
    seen: list[threading.Thread] = []

    class Record(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(threading.current_thread())
            return x

    apply_replicas([Record(), Record()], [(torch.zeros(1),)] * 2, threads=pool)
    pool.close()
    pool.close()  # idempotent
    assert not _join_all(set(seen))
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(lambda: None, lambda _: None)


def test_a_module_that_ran_forwards_still_copies_and_pickles() -> None:
    dp = ReplicationCallbackDataParallel(nn.Linear(2, 2), device_ids=["cpu"] * 2)
    x = torch.randn(4, 2)
    expected = dp(x)
    for clone in (copy.deepcopy(dp), pickle.loads(pickle.dumps(dp))):
        torch.testing.assert_close(clone(x), expected)
        assert threads_of(clone) is not threads_of(dp)
