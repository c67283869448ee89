"""Parallel: results and gradients vs a serial loop, ordering, errors, timeouts, close, thread state."""

from __future__ import annotations

import logging
import random
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest
import torch
from replicate_testutils import assert_close
from torch import nn

from pc_replicate import Parallel, Parallelizable


class MLPStep(Parallelizable):
    """Forward and backward of a shared MLP with a random upstream gradient per item."""

    def __init__(self, net: nn.Module) -> None:
        self.net = net

    def forward_backward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        data, upstream = x
        out = self.net(data)
        (out * upstream).sum().backward()
        return out.detach()


class Call(Parallelizable):
    """Calls a function; for small behavioural tests."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def forward_backward(self, x: Any) -> Any:
        return self.fn(x)


def _mlp() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()


@pytest.mark.parametrize("serial_init", [True, False])
def test_results_and_gradients_match_a_serial_loop(serial_init: bool, no_thread_leak: None) -> None:
    items = [
        (torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)) for _ in range(8)
    ]
    reference = _mlp()
    expected = [MLPStep(reference).forward_backward(item) for item in items]
    expected_grads = [p.grad.clone() for p in reference.parameters()]
    for num_workers in (0, 1, 2, 4):
        net = _mlp()
        with Parallel(num_workers, MLPStep(net), serial_init=serial_init, ordered=True) as parallel:
            for item in items:
                parallel.put(item)
            results = [parallel.get(timeout=30) for _ in items]
        for got, want in zip(results, expected, strict=True):
            assert_close(got, want, atol=1e-12)
        for p, want in zip(net.parameters(), expected_grads, strict=True):
            assert_close(p.grad, want, atol=1e-10)  # summation order varies across threads


def test_ordered_returns_put_order_despite_random_delays(no_thread_leak: None) -> None:
    rng = random.Random(0)
    delays = [rng.uniform(0, 0.02) for _ in range(12)]
    events = [threading.Event() for _ in range(12)]

    def work(i: int) -> int:
        events[i].wait(delays[i])  # a bounded, randomised delay (not a synchronisation)
        return i

    with Parallel(4, Call(work), serial_init=False, ordered=True) as parallel:
        for i in range(12):
            parallel.put(i)
        assert [parallel.get(timeout=30) for _ in range(12)] == list(range(12))


def test_unordered_returns_completion_order(no_thread_leak: None) -> None:
    release = threading.Event()

    def work(i: int) -> int:
        if i == 0:
            assert release.wait(30)
        return i

    with Parallel(2, Call(work), serial_init=False) as parallel:
        parallel.put(0)
        parallel.put(1)
        assert parallel.get(timeout=30) == 1  # item 0 is still blocked
        release.set()
        assert parallel.get(timeout=30) == 0


@pytest.mark.parametrize("num_workers", [0, 2])
def test_error_surfaces_at_get_with_its_type_and_put_then_raises(
    num_workers: int, no_thread_leak: None
) -> None:
    def work(i: int) -> int:
        if i == 1:
            raise KeyError(f"item {i} failed")
        return i

    with Parallel(num_workers, Call(work), serial_init=False, ordered=True) as parallel:
        parallel.put(0)
        parallel.put(1)
        assert parallel.get(timeout=60) == 0
        # The item's KeyError, not a TimeoutError: get() woke on the error, not on its 60 s timeout.
        with pytest.raises(KeyError, match="item 1 failed") as info:
            parallel.get(timeout=60)
        with pytest.raises(RuntimeError, match="a previous item failed with KeyError") as chained:
            parallel.put(2)
        assert chained.value.__cause__ is info.value
        assert parallel.pending == 0


def test_results_in_flight_are_still_delivered_after_a_failure(no_thread_leak: None) -> None:
    release = threading.Event()

    def work(i: int) -> int:
        if i == 0:
            raise KeyError("first")
        assert release.wait(30)
        return i

    with Parallel(2, Call(work), serial_init=False) as parallel:
        parallel.put(1)
        parallel.put(0)
        with pytest.raises(KeyError, match="first"):
            parallel.get(timeout=30)
        release.set()
        assert parallel.get(timeout=30) == 1


def test_inline_serial_init_error_surfaces_at_get(no_thread_leak: None) -> None:
    def work(i: int) -> int:
        raise ValueError("inline failure")

    parallel = Parallel(2, Call(work), serial_init=True)
    parallel.put(0)  # runs inline, does not raise here
    with pytest.raises(ValueError, match="inline failure"):
        parallel.get(timeout=5)
    parallel.close()


def test_get_timeout_and_nothing_pending(no_thread_leak: None) -> None:
    release = threading.Event()
    with Parallel(1, Call(lambda x: release.wait(30) and x), serial_init=False) as parallel:
        with pytest.raises(RuntimeError, match="no pending item"):
            parallel.get(timeout=5)
        parallel.put("x")
        with pytest.raises(TimeoutError, match=r"no result within 0\.1 s"):
            parallel.get(timeout=0.1)
        assert parallel.pending == 1  # the item stays pending
        release.set()
        assert parallel.get(timeout=30) == "x"
        with pytest.raises(RuntimeError, match="no pending item"):
            parallel.get()


def test_close_is_idempotent_drops_unstarted_items_and_stops_threads(no_thread_leak: None) -> None:
    started = threading.Event()
    release = threading.Event()
    ran: list[int] = []

    def work(i: int) -> int:
        ran.append(i)
        if i == 0:
            started.set()
            assert release.wait(30)
        return i

    class ReleaseOnDrop(logging.Handler):
        # close() logs the drop before it stops the workers: item 0 finishes only after items 1..3 are gone.
        def emit(self, record: logging.LogRecord) -> None:
            if "dropped" in record.getMessage():
                release.set()

    log = logging.getLogger("pc_replicate.parallel")
    handler, level = ReleaseOnDrop(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        parallel = Parallel(1, Call(work), serial_init=False, ordered=True)
        for i in range(4):
            parallel.put(i)
        assert started.wait(30)
        parallel.close()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert release.is_set()
    parallel.close()
    assert parallel.get(timeout=5) == 0  # the item that had started still delivers
    assert parallel.pending == 0  # items 1..3 were dropped
    assert ran == [0]
    with pytest.raises(RuntimeError, match="closed"):
        parallel.put(5)
    assert "closed" in repr(parallel)


def test_thread_state_is_captured_at_put(no_thread_leak: None) -> None:
    def probe(_: Any) -> tuple[bool, bool, bool, torch.dtype]:
        return (
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"),
        )

    with Parallel(2, Call(probe), serial_init=False, ordered=True) as parallel:
        parallel.put(0)
        with torch.no_grad():
            parallel.put(1)
        with torch.inference_mode():
            parallel.put(2)
        with torch.autocast("cpu", dtype=torch.float16):
            parallel.put(3)
        results = [parallel.get(timeout=30) for _ in range(4)]
    assert results[0][:3] == (True, False, False)
    assert results[1][:3] == (False, False, False)
    assert results[2][:3] == (False, True, False)
    assert results[3] == (True, False, True, torch.float16)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_workers must be >= 0, got -1"):
        Parallel(-1, Call(abs))
    with pytest.raises(TypeError, match="num_workers must be an int"):
        Parallel(2.0, Call(abs))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="forward_backward"):
        Parallel(1, object())  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="must override"):
        Parallelizable().forward_backward(1)


def test_interpreter_exits_with_a_live_global_parallel() -> None:
    code = textwrap.dedent(
        """
        import threading
        from pc_replicate import Parallel, Parallelizable

        class Block(Parallelizable):
            def forward_backward(self, x):
                return x

        PARALLEL = Parallel(3, Block(), serial_init=False)
        PARALLEL.put(1)
        assert PARALLEL.get(timeout=30) == 1
        print("ok", flush=True)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


class _CountingQueue:
    """Wraps Parallel's out-queue and counts the get() calls that reached it (blocked or not)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.entered = threading.Semaphore(0)

    def put(self, item: Any) -> None:
        self.inner.put(item)

    def get(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.release()
        return self.inner.get(*args, **kwargs)


def test_close_wakes_a_get_whose_item_it_dropped(
    monkeypatch: pytest.MonkeyPatch, no_thread_leak: None
) -> None:
    import pc_replicate.parallel as parallel_module

    monkeypatch.setattr(parallel_module, "CLOSE_TIMEOUT", 0.01)  # close() need not wait for item 0
    started = threading.Event()
    release = threading.Event()

    def work(i: int) -> int:
        if i == 0:
            started.set()
            assert release.wait(60)
        return i

    parallel = Parallel(1, Call(work), serial_init=False)
    counting = _CountingQueue(parallel._out_queue)
    parallel._out_queue = counting  # type: ignore[assignment]
    parallel.put(0)
    assert started.wait(30)
    parallel.put(1)  # queued behind item 0; close() drops it
    outcomes: list[Any] = []

    def getter() -> None:
        try:
            outcomes.append(parallel.get())  # no timeout: only a result or the wake-up can end it
        except RuntimeError as exc:
            outcomes.append(str(exc))

    getters = [threading.Thread(target=getter, name=f"test-getter-{i}") for i in range(2)]
    for thread in getters:
        thread.start()
    for _ in getters:  # both are waiting on the out-queue
        assert counting.entered.acquire(timeout=30)
    parallel.close()  # two getters, one item (0) that can still deliver: one getter is woken
    release.set()
    for thread in getters:
        thread.join(60)
    assert not any(thread.is_alive() for thread in getters), "a get() waited for a dropped item forever"
    assert sorted(outcomes, key=str) == sorted(
        [0, "Parallel.get: no result can come for this get(): close() dropped the items it waited for"],
        key=str,
    )
