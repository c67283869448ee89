"""The gradient server's topology grid: seeded cases, in-process and multi-process runners, the checks.

Every push carries a one-hot gradient ``e_i`` (push ``i`` of the case), the managed model is a zero vector
stepped by a recording SGD with ``lr=1``, so the recorded step gradients show which pushes each step applied
and how often. The invariant: every push a client saw accepted is applied exactly once or booked as dropped in
the ledger, and the final weights are the serial result of applying each applied push once.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pc_server import GradLedger, PushPullGradServerImpl

WAIT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Case:
    """One topology: who reduces, who pushes how often, and the server's settings."""

    name: str
    primary: str
    secondaries: tuple[str, ...]
    clients: tuple[str, ...]
    pushes: tuple[int, ...]  # per client
    batch: int
    method: str
    max_staleness: int | None
    flush_timeout: float | None
    stale_pushes: frozenset[int] = frozenset()  # push indices sent with pp_version 0 (may be stale)
    build_order: tuple[str, ...] = ()  # reducers in construction order

    @property
    def reducers(self) -> list[str]:
        return sorted({self.primary, *self.secondaries})

    @property
    def size(self) -> int:
        return sum(self.pushes)

    def offsets(self) -> list[int]:
        out, acc = [], 0
        for n in self.pushes:
            out.append(acc)
            acc += n
        return out

    def server_kwargs(self) -> dict[str, Any]:
        return {
            "primary_reducer": self.primary,
            "secondary_reducers": list(self.secondaries),
            "reduce_method": self.method,
            "reduce_batch_size": self.batch,
            "max_staleness": self.max_staleness,
            "flush_timeout": self.flush_timeout,
        }


def generate_cases(seed: int, count: int, reducers: Sequence[str], clients: Sequence[str]) -> list[Case]:
    """``count`` seeded cases over the grid; ``reducers[0]`` may be the primary inside or outside the list."""
    rng = random.Random(seed)
    cases = []
    for k in range(count):
        primary = reducers[0]
        inside = k % 2 == 0  # alternate: primary in / out of the secondary list
        pool = list(reducers[1:])
        n_sec = rng.randint(1, min(3, len(pool) + (1 if inside else 0)))
        secondaries = [primary, *rng.sample(pool, n_sec - 1)] if inside else rng.sample(pool, n_sec)
        rng.shuffle(secondaries)
        n_clients = rng.randint(1, min(3, len(clients)))
        batch = rng.randint(1, 4)
        # push counts: a multiple of the batch plus a remainder when the seed says so (the flush path)
        pushes = tuple(rng.randint(1, 3) * batch + rng.randint(0, batch - 1) for _ in range(n_clients))
        max_staleness = rng.choice([None, 0, 1])
        size = sum(pushes)
        stale = frozenset(i for i in range(size) if max_staleness is not None and rng.random() < 0.3)
        order = sorted({primary, *secondaries})
        rng.shuffle(order)
        cases.append(
            Case(
                name=f"grid{seed}_{k}",
                primary=primary,
                secondaries=tuple(secondaries),
                clients=tuple(rng.sample(list(clients), n_clients)),
                pushes=pushes,
                batch=batch,
                method=rng.choice(["sum", "mean"]),
                max_staleness=max_staleness,
                flush_timeout=rng.choice([None, 0.05]),
                stale_pushes=stale,
                build_order=tuple(order),
            )
        )
    return cases


class OneHot(nn.Module):
    """A zero vector with one slot per push of a case."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(size, dtype=torch.float64))


class RecordingSGD:
    """SGD with lr 1 that records every step's gradient."""

    def __init__(self, params: Any) -> None:
        self.params = list(params)
        self.param_groups = [{"lr": 1.0}]
        self.steps: list[list[float]] = []

    def step(self) -> None:
        with torch.no_grad():
            for p in self.params:
                self.steps.append(p.grad.tolist())
                p -= p.grad


def build_reducer(case: Case, group: Any, me: str) -> tuple[PushPullGradServerImpl, OneHot | None]:
    impl = PushPullGradServerImpl(case.name, group, **case.server_kwargs())
    model = None
    if me == case.primary:
        model = OneHot(case.size)
        impl.manage_model(model, RecordingSGD(model.parameters()))
    impl.start()
    return impl, model


def push_all(case: Case, client: Any, index: int, accepted: list[bool | None]) -> None:
    """Client ``index`` of ``case`` pushes its one-hot gradients; ``accepted[i]`` gets push i's result."""
    model = OneHot(case.size)
    start = case.offsets()[index]
    for i in range(start, start + case.pushes[index]):
        grad = torch.zeros(case.size, dtype=torch.float64)
        grad[i] = 1.0
        model.w.grad = grad
        if i in case.stale_pushes:
            model.pp_version = 0
        accepted[i] = client.push(model)


def stop_in_order(case: Case, impls: dict[str, PushPullGradServerImpl]) -> None:
    """Secondaries that are not the primary first (they forward what they hold), then the primary."""
    for name, impl in impls.items():
        if name != case.primary:
            impl.stop(timeout=WAIT_S)
    impls[case.primary].stop(timeout=WAIT_S)


def run_case_in_process(case: Case, hub: Any) -> dict[str, Any]:
    """Run ``case`` on a fake group hub (threads, no RPC); return what :func:`check_case` needs."""
    impls: dict[str, PushPullGradServerImpl] = {}
    model = opt = None
    for name in case.build_order:
        impl, m = build_reducer(case, hub.group(name), name)
        impls[name] = impl
        if m is not None:
            model, opt = m, impl.optimizer
    accepted: list[bool | None] = [None] * case.size
    accessors = [hub.group(c).get_paired(case.name).to_here() for c in case.clients]
    errors: list[BaseException] = []

    def client(index: int) -> None:
        try:
            push_all(case, accessors[index], index, accepted)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(case.clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not errors, errors
    stop_in_order(case, impls)
    for impl in impls.values():
        impl.watch()
    assert model is not None
    assert opt is not None
    return {
        "accepted": accepted,
        "client_ids": [a.client_id for a in accessors],
        "steps": opt.steps,
        "final": model.w.detach().tolist(),
        "ledger": GradLedger.merge(impl.ledger() for impl in impls.values()),
    }


def check_case(case: Case, out: dict[str, Any]) -> None:
    """The invariants: a balanced ledger and every accepted push applied exactly once or booked as dropped."""
    accepted = out["accepted"]
    assert None not in accepted, f"{case.name}: a push did not return"
    ledger: GradLedger = out["ledger"]
    assert ledger.balanced(), f"{case.name}: unbalanced ledger {ledger}"
    assert ledger.total.accepted == sum(map(bool, accepted)), (case.name, ledger.total)
    applied_at: dict[int, int] = {}
    expected = [0.0] * case.size
    for s, grad in enumerate(out["steps"]):
        slots = [i for i, g in enumerate(grad) if g != 0.0]
        assert slots, f"{case.name}: step {s} applied nothing"
        want = 1.0 if case.method == "sum" else 1.0 / len(slots)
        for i in slots:
            assert grad[i] == want, f"{case.name}: step {s} slot {i} is {grad[i]}, not {want}"
            assert i not in applied_at, f"{case.name}: push {i} applied in steps {applied_at[i]} and {s}"
            assert accepted[i], f"{case.name}: push {i} was refused but applied"
            applied_at[i] = s
            expected[i] -= want
    assert len(applied_at) == ledger.total.applied, (case.name, len(applied_at), ledger.total)
    for index, cid in enumerate(out["client_ids"]):
        start = case.offsets()[index]
        mine = range(start, start + case.pushes[index])
        counts = ledger.clients.get(cid)
        n_accepted = sum(bool(accepted[i]) for i in mine)
        assert (counts.accepted if counts else 0) == n_accepted, (case.name, cid, counts)
        assert (counts.applied if counts else 0) == sum(i in applied_at for i in mine), (case.name, cid)
    if case.max_staleness is None:  # nothing may be dropped: every accepted push applied exactly once
        assert ledger.total.dropped == 0, (case.name, ledger.total)
        assert sorted(applied_at) == [i for i, a in enumerate(accepted) if a], case.name
    assert out["final"] == expected, f"{case.name}: weights {out['final']} != serial result {expected}"


# ----------------------------------------------------------------------------------------- multi-process


class _Control:
    """Per-process control service: counts 'clients done' and 'secondary drained' notices (no barrier)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.seen: dict[str, int] = {}

    def notify(self, what: str) -> None:
        with self.cond:
            self.seen[what] = self.seen.get(what, 0) + 1
            self.cond.notify_all()

    def wait(self, what: str, count: int) -> None:
        with self.cond:
            ok = self.cond.wait_for(lambda: self.seen.get(what, 0) >= count, WAIT_S)
        assert ok, f"timed out waiting for {count} x {what!r} (saw {self.seen})"


REGRESSION = Case(
    name="issue14",
    primary="0",
    secondaries=("0", "1"),
    clients=("2",),
    pushes=(7,),
    batch=2,
    method="sum",
    max_staleness=None,
    flush_timeout=1.0,
    build_order=("0", "1"),
)
"""The reported topology: reducers '0' and '1', primary '0', client '2' pushing the same gradients 7 times."""


def regression_client(group: Any) -> dict[str, Any]:
    from server_models import ThreeLayer

    gs = group.get_paired(REGRESSION.name).to_here()
    model = ThreeLayer()
    results = []
    for _ in range(7):
        for p, g in zip(model.parameters(), (6.0, 3.0, 2.0), strict=True):
            p.grad = torch.full_like(p, g)
        results.append(gs.push(model))
    # poll until the seven pushes are in (the report: the weights stopped at w0 - 3g for good)
    target = (1.0 - 7 * 6.0, 2.0 - 7 * 3.0, 3.0 - 7 * 2.0)
    pause = threading.Event()
    deadline = time.monotonic() + WAIT_S
    while model.weights() != target and time.monotonic() < deadline:
        pause.wait(0.05)  # a poll interval, not synchronisation: the loop ends on the observed weights
        gs.pull(model)
    return {"accepted": results, "polled": model.weights(), "ledger": gs.ledger(), "client_id": gs.client_id}


def grid_world(rank: int, cases: list[Case]) -> dict[str, Any]:
    """Every case of ``cases`` plus the issue-14 regression in one world; returns this rank's observations.

    Reducer processes wait for the clients on a condition fed by RPC notices; :func:`barrier_world` runs the
    reported pattern with the reducer processes parked in ``group.barrier()`` instead.
    """
    torch.set_num_threads(1)
    from server_models import PlainSGD, ThreeLayer

    from pc_distributed import get_world

    world = get_world()
    assert world is not None
    me = str(rank)
    group = world.create_rpc_group("grid", ["0", "1", "2"])
    control = _Control()
    group.register(f"ctl/{me}", control.notify)
    everything = [REGRESSION, *cases]
    impls: dict[str, PushPullGradServerImpl] = {}
    models: dict[str, Any] = {}
    group.barrier(WAIT_S)  # control services exist everywhere
    for case in everything:
        if me not in case.reducers:
            continue
        if case is REGRESSION:
            impl = PushPullGradServerImpl(case.name, group, **case.server_kwargs())
            if me == case.primary:
                model = ThreeLayer()
                impl.manage_model(model, PlainSGD(model.parameters()))
                models[case.name] = model
            impl.start()
        else:
            impl, model = build_reducer(case, group, me)
            if model is not None:
                models[case.name] = model
        impls[case.name] = impl
    group.barrier(WAIT_S)  # every server is paired (reducer threads idle: no traffic yet)
    out: dict[str, Any] = {"clients": {}, "ledgers": {}, "steps": {}, "final": {}}
    client_procs = sorted({c for case in everything for c in case.clients})
    if me in client_procs:
        if me in REGRESSION.clients:
            out["regression"] = regression_client(group)
        for case in cases:
            if me in case.clients:
                index = case.clients.index(me)
                gs = group.get_paired(case.name).to_here()
                accepted: list[bool | None] = [None] * case.size
                push_all(case, gs, index, accepted)
                start = case.offsets()[index]
                out["clients"][case.name] = (accepted[start : start + case.pushes[index]], gs.client_id)
        for reducer in sorted({r for case in everything for r in case.reducers}):
            group.registered_sync(f"ctl/{reducer}", args=("clients done",))
    if impls:
        control.wait("clients done", len(client_procs))
        for name, impl in impls.items():  # secondaries first: they forward what they hold
            case = next(c for c in everything if c.name == name)
            if me != case.primary:
                impl.stop(timeout=WAIT_S)
                group.registered_sync(f"ctl/{case.primary}", args=(f"drained {name}",))
        for name, impl in impls.items():
            case = next(c for c in everything if c.name == name)
            if me == case.primary:
                control.wait(f"drained {name}", len([r for r in case.reducers if r != me]))
                impl.stop(timeout=WAIT_S)
                opt = impl.optimizer
                out["steps"][name] = getattr(opt, "steps", None)
                out["final"][name] = (
                    models[name].weights() if name == REGRESSION.name else models[name].w.detach().tolist()
                )
            impl.watch()
            out["ledgers"][name] = impl.ledger()
    group.barrier(WAIT_S)  # every reducer stopped
    return out


def world_outcome(results: list[dict[str, Any]], case: Case) -> dict[str, Any]:
    """Assemble one generated case's observations from every rank's result, for :func:`check_case`."""
    accepted: list[bool | None] = [None] * case.size
    client_ids = []
    for index, client in enumerate(case.clients):
        flags, cid = results[int(client)]["clients"][case.name]
        start = case.offsets()[index]
        accepted[start : start + len(flags)] = flags
        client_ids.append(cid)
    primary = results[int(case.primary)]
    return {
        "accepted": accepted,
        "client_ids": client_ids,
        "steps": primary["steps"][case.name],
        "final": primary["final"][case.name],
        "ledger": GradLedger.merge(results[int(r)]["ledgers"][case.name] for r in case.reducers),
    }
