"""Helpers of the elastic trainer's tests: the model, the data, the workers and the single-process replay.

Every member starts from parameters drawn from a generator seeded by its name, so that the replay knows which
member's start the job took (the first quorum's source: its lowest name) and a member that trained on a
state it did not receive would show up as a mismatch.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import threading
from collections.abc import Sequence
from typing import Any

import torch

from pc_distributed import ElasticDataParallel, ElasticSampler, StepContext, get_world

N_SAMPLES = 96
BATCH = 12
SAMPLER = ElasticSampler(N_SAMPLES, BATCH, seed=7)
_GEN = torch.Generator().manual_seed(1234)
X = torch.randn(N_SAMPLES, 5, dtype=torch.float64, generator=_GEN)
Y = torch.randn(N_SAMPLES, 2, dtype=torch.float64, generator=_GEN)


def make_model(name: str) -> torch.nn.Module:
    """A small float64 MLP with batch norm whose start depends on ``name`` only (not on the global RNG).

    The batch norm's running statistics are buffers the members must keep equal (averaged at each commit,
    restored at each abort): the replay checks them.
    """
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4), torch.nn.Tanh(), torch.nn.Linear(4, 2)
    ).double()
    gen = torch.Generator().manual_seed(sum(ord(c) * 31**i for i, c in enumerate(name)) % (2**31))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, dtype=p.dtype, generator=gen))
    return model


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum: a joining member needs the optimizer's state, not only the parameters."""
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def shard_loss(model: torch.nn.Module, ctx: StepContext) -> int:
    """Forward and backward on this member's share of the step; return the samples trained."""
    idx = SAMPLER.indices(ctx.step, ctx.members, ctx.member)
    torch.nn.functional.mse_loss(model(X[idx]), Y[idx]).backward()
    return len(idx)


def replay(log: Sequence[tuple[int, Sequence[str]]]) -> list[torch.Tensor]:
    """Replay a complete quorum log (steps 0, 1, ...) in one process; return the final parameters.

    Each step: every member's gradient on its share, weighted by its share's size, averaged; one SGD step.
    Each member's forward starts from the step's buffers; the floating buffers after the step are the
    members' weighted average, the others (the batch count) what every member has.
    """
    steps = [step for step, _ in log]
    if steps != list(range(len(steps))):
        raise ValueError(f"the log must hold every step from 0 in order, got steps {steps}")
    model = make_model(min(log[0][1]))  # the first quorum's source: its lowest name
    opt = make_optimizer(model)
    for step, members in log:
        total = [torch.zeros_like(p) for p in model.parameters()]
        start = [b.clone() for b in model.buffers()]
        buffers = [torch.zeros_like(b) for b in model.buffers()]
        weight = 0
        for member in sorted(members):
            model.zero_grad()
            with torch.no_grad():
                for b, b0 in zip(model.buffers(), start, strict=True):
                    b.copy_(b0)
            n = shard_loss(model, StepContext(step, tuple(sorted(members)), member, 0))
            for acc, p in zip(total, model.parameters(), strict=True):
                acc += p.grad * n
            for i, b in enumerate(model.buffers()):
                buffers[i] = buffers[i] + b * n if b.is_floating_point() else b.clone()
            weight += n
        for acc, p in zip(total, model.parameters(), strict=True):
            p.grad = acc / weight
        with torch.no_grad():
            for acc, b in zip(buffers, model.buffers(), strict=True):
                b.copy_(acc / weight if b.is_floating_point() else acc)
        opt.step()
    return params(model)


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's parameters, then its buffers (copies): what must equal the replay's."""
    return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


# -- multi-process workers (run_world) ---

FAST = {"heartbeat_period": 0.2, "member_timeout": 5.0, "collective_timeout": 10.0, "quorum_timeout": 60.0}


def _train(
    name: str, steps: int, faults: dict[tuple[int, str], str], spawn_at: int | None, initial: int
) -> dict[str, Any]:
    """Train ``steps`` steps as member ``name`` under the launcher's store; inject ``faults``.

    ``faults`` maps (step, member) to "kill" (SIGKILL inside compute) or "stop" (SIGSTOP inside compute;
    member "0" resumes it with SIGCONT two steps later and holds that step until the resumed member is back
    at a step boundary). With ``spawn_at``, member "0" starts a new process (member "new") at that step and
    collects its result at the end.
    """
    torch.set_num_threads(1)
    model = make_model(name)
    edp = ElasticDataParallel(
        model, make_optimizer(model), name=name, job="t", initial_members=initial, **FAST
    )
    joiner: Any = None
    reader: Any = None
    resumed: set[str] = set()

    def compute(ctx: StepContext) -> int:
        nonlocal joiner, reader
        fault = faults.get((ctx.step, ctx.member))
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "stop":
            edp._stores.store.set(f"pid/{name}", str(os.getpid()))  # for member "0" to kill it at the end
            os.kill(os.getpid(), signal.SIGSTOP)
        for (step, member), kind in faults.items():
            if kind == "stop" and name == "0" and ctx.step == step + 2 and member not in resumed:
                resumed.add(member)
                os.kill(int(edp._stores.store.get(f"pid/{member}").decode()), signal.SIGCONT)
                # The resumed member finds its attempt aborted and comes to the next boundary (this
                # member's next attempt): hold this step until it is there, so it rejoins before the end.
                edp._stores.waits.wait([f"ready/{edp._attempt}/{member}"], 120.0)
        if spawn_at is not None and ctx.step == spawn_at and name == "0" and joiner is None:
            ctx_mp = mp.get_context("spawn")
            reader, writer = ctx_mp.Pipe(duplex=False)
            joiner = ctx_mp.Process(target=joiner_main, args=("new", steps, writer), name="pc-elastic-joiner")
            joiner.start()
            writer.close()
        if spawn_at is not None and ctx.step == spawn_at + 1 and name == "0":
            # Hold the step until the new process has enlisted (it then enters at the next boundary).
            edp._stores.waits.wait(["reg/2"], 120.0)
        return shard_loss(model, ctx)

    try:
        while edp.step < steps:
            edp.train_step(compute)
        result: dict[str, Any] = {
            "name": name,
            "params": params(model),
            "log": [tuple(e) for e in edp.quorum_log],
            "aborted": edp.aborted_attempts,
        }
        if name == "0" and joiner is not None:
            if not reader.poll(120):
                raise TimeoutError("the joining process sent no result within 120 s")
            result["joiner"] = pickle.loads(reader.recv_bytes())
            joiner.join(30)
            result["joiner_exitcode"] = joiner.exitcode
        return result
    finally:
        edp.close()
        if joiner is not None and joiner.is_alive():
            joiner.kill()
            joiner.join(10)


def elastic_worker(
    rank: int, steps: int, faults: dict[tuple[int, str], str], spawn_at: int | None = None
) -> Any:
    """run_world's function: member ``str(rank)``."""
    world = get_world()
    return _train(str(rank), steps, faults, spawn_at, 1 if world is None else world.world_size)


def joiner_main(name: str, steps: int, conn: Any) -> None:
    """A new process that joins a running job (the launcher's store, from the inherited environment)."""
    try:
        result = _train(name, steps, {}, None, 1)
        conn.send_bytes(pickle.dumps(result))  # by value: torch's reductions would share through fds
    finally:
        conn.close()


def run_threads(fn: Any, names: Sequence[str], timeout: float = 120.0) -> dict[str, Any]:
    """Run ``fn(name)`` in one thread per name; return results (or exceptions) by name."""
    out: dict[str, Any] = {}

    def body(name: str) -> None:
        try:
            out[name] = fn(name)
        except BaseException as exc:  # handed to the test
            out[name] = exc

    threads = [threading.Thread(target=body, args=(n,), daemon=True) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    alive = [n for n, t in zip(names, threads, strict=True) if t.is_alive()]
    if alive:
        raise TimeoutError(f"threads {alive} still running after {timeout} s")
    return out
