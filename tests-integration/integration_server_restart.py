"""A gradient-server job that torchrun restarts: run by test_integration_server_torchrun.py (docs/server.md).

``torchrun --standalone --nproc_per_node 3 --max-restarts 1 integration_server_restart.py CKPT_DIR``

Rank 0 is the primary reducer (and a secondary), rank 1 a secondary, rank 2 the client. Every push is the
gradient 1 for each weight with ``reduce_batch_size=1``, so each push is one optimizer step.

* First attempt (``TORCHELASTIC_RESTART_COUNT=0``): the client pushes ``BEFORE`` times and waits until
  they are applied; every reducer writes its ``state_dict()`` (the server keeps running); the client pushes
  again, and the primary SIGKILLs itself once ``KILL_AFTER`` of those are applied (an event in the data, not
  a timer). torchrun sees the dead worker, stops the other two and starts all three again.
* Second attempt: every reducer loads its checkpoint before ``start()``; the client pulls (the checkpoint's
  version), pushes ``AFTER`` times; everybody stops; the client writes ``client.json`` (the merged ledger),
  rank 0 ``primary.json`` (weights, version, scheduler step count). The pushes made after the checkpoint in
  the first attempt died with it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from typing import Any

import torch

import pc_distributed as pd
from pc_server import PushPullGradServerImpl

BEFORE, KILL_AFTER, AFTER = 4, 2, 3
WAIT_S = 60.0
MEMBERS = ["0", "1", "2"]


class ThreeWeights(torch.nn.Module):
    """Three scalar weights 1, 2, 3."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))


class MomentumSGD:
    """``b = m b + g; p -= lr b`` with a ``state_dict`` (a restart that forgot it gives other weights)."""

    def __init__(self, params: Any, lr: float = 0.1, momentum: float = 0.9) -> None:
        self.params = list(params)
        self.param_groups = [{"lr": lr}]
        self.momentum = momentum
        self.bufs = [torch.zeros_like(p) for p in self.params]

    def step(self) -> None:
        lr = self.param_groups[0]["lr"]
        with torch.no_grad():
            for p, b in zip(self.params, self.bufs, strict=True):
                b.mul_(self.momentum).add_(p.grad)
                p -= lr * b

    def state_dict(self) -> dict[str, Any]:
        return {"lr": self.param_groups[0]["lr"], "bufs": [b.clone() for b in self.bufs]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.param_groups[0]["lr"] = state["lr"]
        for b, saved in zip(self.bufs, state["bufs"], strict=True):
            b.copy_(saved)


class HalveEvery2:
    """Halves the lr every second step; its step count is its state."""

    def __init__(self, optimizer: MomentumSGD) -> None:
        self.optimizer = optimizer
        self.last_epoch = 0

    def step(self) -> None:
        self.last_epoch += 1
        if self.last_epoch % 2 == 0:
            self.optimizer.param_groups[0]["lr"] *= 0.5

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_epoch = int(state["last_epoch"])


def serial_weights(steps: int) -> list[float]:
    """The weights after ``steps`` pushes, each applied once, in one process."""
    model = ThreeWeights()
    opt = MomentumSGD(model.parameters())
    sched = HalveEvery2(opt)
    for _ in range(steps):
        model.w.grad = torch.ones(3)
        opt.step()
        sched.step()
    return model.w.detach().tolist()


def push_until(gs: Any, model: ThreeWeights, n: int, target: int | None) -> list[bool]:
    """Push ``n`` gradients of ones; then pull until the published version reaches ``target``."""
    accepted = []
    for _ in range(n):
        model.w.grad = torch.ones(3)
        accepted.append(gs.push(model))
    deadline = time.monotonic() + WAIT_S
    while target is not None and model.pp_version < target and time.monotonic() < deadline:
        gs.pull(model)  # one bounded RPC each
    return accepted


def quiet_checkpoint(impl: PushPullGradServerImpl, rank: int) -> dict[str, Any]:
    """This reducer's checkpoint once it holds no push (none queued, none in a forward awaiting its reply).

    The primary publishes a version before the secondary that forwarded it has the reply, so a client seeing
    the version is not yet a quiet moment (docs/server.md, "What a checkpoint of a running server holds"): a
    secondary's checkpoint taken meanwhile still holds the bundle, and the restored server applies it again.
    """
    deadline = time.monotonic() + WAIT_S
    while True:
        state = impl.state_dict()
        held = [part["pending"] for part in (state["primary"], state["secondary"]) if part is not None]
        if not any(held):
            return state
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: the reducer still holds pushes after {WAIT_S:g} s: {held}")
        time.sleep(0.01)  # a look at the reducer's state between tries: the reply is one RPC away


def main(ckpt_dir: str) -> None:
    rank = int(os.environ["RANK"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    # World scopes its store keys (and the process group's and RPC's) per torchrun attempt, so a restarted
    # attempt meets on torchrun's own store without reading the dead attempt's addresses.
    world = pd.World(name=str(rank), rpc_timeout=10, dist_timeout=60)
    group = world.create_rpc_group("r", MEMBERS)
    impl = managed = None
    if rank in (0, 1):
        impl = PushPullGradServerImpl(
            "gs", group, primary_reducer="0", secondary_reducers=["0", "1"], reduce_batch_size=1
        )
        if rank == 0:
            managed = ThreeWeights()
            opt = MomentumSGD(managed.parameters())
            impl.manage_model(managed, opt, HalveEvery2(opt))
        if restart > 0:  # torchrun restarted the job: resume from this reducer's checkpoint
            impl.load_state_dict(torch.load(os.path.join(ckpt_dir, f"{rank}.pt"), weights_only=False))
        impl.start()
    group.barrier(WAIT_S)  # every reducer started (and the accessor paired)
    gs = group.get_paired("gs").to_here() if rank == 2 else None
    model = ThreeWeights()
    if restart == 0:
        if gs is not None:
            gs.pull(model)
            push_until(gs, model, BEFORE, BEFORE)
        group.barrier(WAIT_S)  # the first pushes are applied
        if impl is not None:  # checkpoint while the server runs, at a quiet moment; write-then-rename
            path = os.path.join(ckpt_dir, f"{rank}.pt")
            torch.save(quiet_checkpoint(impl, rank), path + ".tmp")
            os.replace(path + ".tmp", path)
        group.barrier(WAIT_S)  # every checkpoint written
        if impl is not None and rank == 0:
            impl.wait_for_version(BEFORE + KILL_AFTER, WAIT_S)
            print(f"rank 0: version {impl.stats().version}, killing myself", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # a crash, mid-run
        if gs is not None:
            try:
                push_until(gs, model, 2 * KILL_AFTER, None)
            except (ConnectionError, TimeoutError, RuntimeError) as exc:
                print(f"rank 2: push failed as the primary died: {type(exc).__name__}", flush=True)
        group.barrier(WAIT_S)  # never passes: rank 0 is dead; torchrun stops this process first
        raise SystemExit(f"rank {rank}: the first attempt was meant to die")
    out: dict[str, Any] = {"restart": restart}
    if gs is not None:
        gs.pull(model)
        out["start_version"] = model.pp_version
        out["accepted"] = push_until(gs, model, AFTER, BEFORE + AFTER)
    group.barrier(WAIT_S)  # every push applied
    if impl is not None:
        impl.stop(timeout=WAIT_S)
        impl.watch()
    group.barrier(WAIT_S)  # every reducer stopped: the merged ledger balances
    if gs is not None:
        ledger = gs.ledger()
        out["ledger"] = dataclasses.asdict(ledger.total)
        out["balanced"] = ledger.balanced()
        out["clients"] = {c: n.applied for c, n in ledger.clients.items()}
        with open(os.path.join(ckpt_dir, "client.json"), "w") as fh:
            json.dump(out, fh)
    if impl is not None and managed is not None:
        out["weights"] = managed.w.detach().tolist()
        out["version"] = impl.stats().version
        out["last_epoch"] = impl.lr_scheduler.last_epoch
        with open(os.path.join(ckpt_dir, "primary.json"), "w") as fh:
            json.dump(out, fh)
    group.barrier(WAIT_S)
    world.stop()


if __name__ == "__main__":
    main(sys.argv[1])
