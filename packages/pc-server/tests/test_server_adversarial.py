"""Property-based checks of the gradient server's ledger and checkpoints against a serial model.

Hypothesis draws sequences of operations (push, save, load, load again, restore into a new server, run) and
thread interleavings; after every step the server must agree with a serial model of what it should hold,
and once run the managed model must equal the serial result of every accepted push (plain SGD with lr 1 on
gradients of ones, summed: weights minus the number of applied pushes, whatever the order). The runs are
derandomized (the same examples on every run, for CI) and bounded; a failure prints the example and the
``@reproduce_failure`` blob.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from server_fakegroup import Hub
from server_models import PlainSGD, ThreeLayer, through_disk
from server_threads import hammer, push_ones

from pc_server import PushPullGradServerImpl, ReducerStoppedError

pytestmark = pytest.mark.adversarial

WAIT = 30.0

OPS = st.lists(
    st.sampled_from(["push", "push", "save", "load", "load_again", "restore", "run"]), min_size=1, max_size=14
)


@dataclasses.dataclass
class Expected:
    """The serial model of one server process (a primary that is its own only secondary)."""

    accepted: int = 0
    applied: int = 0
    booked_since_load: bool = False
    running_done: bool = False

    @property
    def held(self) -> int:
        return self.accepted - self.applied


class Run:
    """One example: the live server, its client, the last checkpoint and what the serial model expects."""

    def __init__(self) -> None:
        self.servers: list[PushPullGradServerImpl] = []
        self.checkpoint: tuple[dict[str, Any], Expected] | None = None
        self.build(None)

    def build(self, state: Any) -> None:
        hub = Hub(["0", "1"])
        self.server = PushPullGradServerImpl(
            "gs", hub.group("0"), secondary_reducers=["0"], max_queue_size=1024, flush_timeout=None
        )
        self.servers.append(self.server)
        self.model = ThreeLayer()
        self.server.manage_model(self.model, PlainSGD(self.model.parameters()))
        self.expected = Expected()
        if state is not None:
            self.server.load_state_dict(state[0])
            self.expected = dataclasses.replace(state[1], booked_since_load=False, running_done=False)
        self.client = hub.group("1").get_paired("gs").to_here()

    def step(self, op: str) -> None:
        exp = self.expected
        if op == "push":
            if exp.running_done:
                with pytest.raises(ReducerStoppedError):
                    push_ones(self.client, 1)
                return
            assert push_ones(self.client, 1) == 1
            exp.accepted += 1
            exp.booked_since_load = True
        elif op == "save":
            self.checkpoint = (through_disk(self.server.state_dict()), dataclasses.replace(exp))
        elif op in ("load", "load_again") and self.checkpoint is not None:
            for _ in range(2 if op == "load_again" else 1):
                self.load(self.checkpoint)
        elif op == "restore" and self.checkpoint is not None:  # the process died: a new one from the file
            self.build(self.checkpoint)
        elif op == "run" and exp.running_done:
            with pytest.raises(ReducerStoppedError, match="was stopped and cannot restart"):
                self.server.start()
        elif op == "run":
            self.server.start()
            self.server.stop(timeout=WAIT)
            exp.applied = exp.accepted
            exp.running_done = True

    def load(self, checkpoint: tuple[dict[str, Any], Expected]) -> None:
        exp = self.expected
        if exp.running_done:
            with pytest.raises(RuntimeError, match="must be called before start"):
                self.server.load_state_dict(checkpoint[0])
        elif exp.booked_since_load:
            with pytest.raises(RuntimeError, match="booked pushes since"):
                self.server.load_state_dict(checkpoint[0])
        else:
            self.server.load_state_dict(checkpoint[0])
            self.expected = dataclasses.replace(checkpoint[1], booked_since_load=False, running_done=False)

    def check(self) -> None:
        exp = self.expected
        ledger = self.server.ledger()
        assert (ledger.total.accepted, ledger.total.applied, ledger.total.duplicates) == (
            exp.accepted,
            exp.applied,
            0,
        )
        state = self.server.state_dict()
        held = len(state["secondary"]["pending"]) + sum(
            n for bundle in state["primary"]["pending"] for _sums, n, _per in bundle.values()
        )
        assert held == exp.held
        assert state["primary"]["version"] == self.server.stats().version
        a = float(exp.applied)
        assert self.model.weights() == (1.0 - a, 2.0 - a, 3.0 - a)

    def finish(self) -> None:
        if not self.expected.running_done:
            self.step("run")
        self.check()
        ledger = self.server.ledger()
        assert ledger.balanced()
        assert ledger.total.applied == ledger.total.accepted == self.expected.accepted

    def close(self) -> None:
        for server in self.servers:
            server.stop(timeout=WAIT)


@given(ops=OPS)
def test_checkpoint_sequences_match_the_serial_model(ops: list[str]) -> None:
    run = Run()
    try:
        for op in ops:
            run.step(op)
            run.check()
        run.finish()
    finally:
        run.close()


@settings(max_examples=max(1, settings.default.max_examples * 2 // 5))  # each example runs threads
@given(
    threads=st.integers(2, 4),
    pushes=st.integers(1, 25),
    batch=st.integers(1, 4),
    secondaries=st.sampled_from([["0"], ["0", "1"], ["1"]]),
)
def test_a_shared_client_under_thread_interleavings_books_every_push_once(
    threads: int, pushes: int, batch: int, secondaries: list[str]
) -> None:
    hub = Hub(["0", "1", "2"])
    managed = ThreeLayer()
    impls = []
    for name in sorted({"0", *secondaries}):
        impl = PushPullGradServerImpl(
            "gs",
            hub.group(name),
            secondary_reducers=secondaries,
            reduce_batch_size=batch,
            max_queue_size=1024,
            flush_timeout=None,
        )
        if name == "0":
            impl.manage_model(managed, PlainSGD(managed.parameters()))
        impls.append(impl)
    try:
        for impl in impls:
            impl.start()
        client = hub.group("2").get_paired("gs").to_here()
        accepted = sum(hammer(threads, lambda _i: push_ones(client, pushes)))
    finally:
        for impl in reversed(impls):  # secondaries before the primary ("0", first)
            impl.stop(timeout=WAIT)
    from pc_server import GradLedger

    ledger = GradLedger.merge(impl.ledger() for impl in impls)
    assert accepted == threads * pushes
    assert (ledger.total.accepted, ledger.total.applied, ledger.total.duplicates) == (accepted, accepted, 0)
    assert ledger.balanced()
    a = float(accepted)
    assert managed.weights() == (1.0 - a, 2.0 - a, 3.0 - a)
    assert torch.equal(managed.fc1.weight, torch.full((1, 1), 1.0 - a))
