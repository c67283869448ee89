"""Worlds of the restart test: train and checkpoint, kill the primary, then resume from the checkpoint.

Reducers '0' (primary, also a secondary) and '1' (secondary); '2' is the client. Every push carries the
gradient 1 for each weight and ``reduce_batch_size=1``, so each push is one optimizer step and the serial
result is :func:`serial_weights`. The optimizer and scheduler carry state of their own (momentum buffers,
a step count) so that a restart that forgot them gives other weights.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import torch

from pc_server import PushPullGradServerImpl

WAIT_S = 60.0
BEFORE, AFTER = 5, 3  # pushes before the checkpoint, and after the restart


class MomentumSGD:
    """``b = m b + g; p -= lr b`` with a ``state_dict`` (torch.optim's first use costs seconds per child)."""

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
        if len(state["bufs"]) != len(self.bufs):
            raise ValueError(f"{len(state['bufs'])} momentum buffers for {len(self.bufs)} parameters")
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


def serial_weights(steps: int) -> tuple[float, float, float]:
    """The weights after ``steps`` pushes applied once each, in one process."""
    from server_models import ThreeLayer

    model = ThreeLayer()
    opt = MomentumSGD(model.parameters())
    sched = HalveEvery2(opt)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        sched.step()
    return model.weights()


def _reducer(group: Any, rank: int, checkpoint: str | None) -> tuple[PushPullGradServerImpl, Any]:
    from server_models import ThreeLayer

    impl = PushPullGradServerImpl(
        "gs",
        group,
        primary_reducer="0",
        secondary_reducers=["0", "1"],
        reduce_batch_size=1,
        flush_timeout=None,
    )
    model = None
    if rank == 0:
        model = ThreeLayer()
        if checkpoint is not None:
            with torch.no_grad():
                model.fc1.weight.fill_(-5.0)  # whatever it is, the checkpoint overwrites it
        opt = MomentumSGD(model.parameters())
        impl.manage_model(model, opt, HalveEvery2(opt))
    if checkpoint is not None:
        impl.load_state_dict(torch.load(checkpoint, weights_only=False))
    impl.start()
    return impl, model


def _push_and_wait(gs: Any, n: int, target: int) -> tuple[list[bool], int]:
    from server_models import ThreeLayer

    model = ThreeLayer()
    gs.pull(model)
    start = model.pp_version
    accepted = []
    for _ in range(n):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        accepted.append(gs.push(model))
    deadline = time.monotonic() + WAIT_S  # applied asynchronously: poll the published version
    while model.pp_version < target and time.monotonic() < deadline:
        gs.pull(model)
    return accepted, start


def _ledger_json(ledger: Any) -> dict[str, Any]:
    import dataclasses

    return {"total": dataclasses.asdict(ledger.total), "balanced": ledger.balanced()}


def before_world(rank: int, ckpt_dir: str) -> None:
    """Train BEFORE steps, checkpoint every reducer after stop(), then SIGKILL the primary; '2' reports."""
    torch.set_num_threads(1)
    from pc_distributed import get_world

    world = get_world()
    assert world is not None
    group = world.create_rpc_group("r", ["0", "1", "2"])
    impl = _reducer(group, rank, None)[0] if rank in (0, 1) else None
    group.barrier(WAIT_S)  # paired and started
    report: dict[str, Any] = {}
    if rank == 2:
        gs = group.get_paired("gs").to_here()
        report["accepted"], _ = _push_and_wait(gs, BEFORE, BEFORE)
    group.barrier(WAIT_S)  # every push applied
    if impl is not None:
        impl.stop(timeout=WAIT_S)
        torch.save(impl.state_dict(), os.path.join(ckpt_dir, f"{rank}.pt"))
    group.barrier(WAIT_S)  # checkpoints written
    if rank == 2:
        report["ledger"] = _ledger_json(gs.ledger())
    group.barrier(WAIT_S)  # the client read the ledger
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # the primary dies (as a crash would)
    if rank == 2:
        from server_models import ThreeLayer

        # a model of the served architecture: a pull before the kill lands loads it (any model whose version
        # differs from the server's is loaded), and only the dead primary may end the loop
        local = ThreeLayer()
        for what, call in (("pull", lambda: gs.pull(local)), ("ledger", gs.ledger)):
            outcome = ["no error", ""]
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline:  # until the kill has landed; every call is bounded
                try:
                    call()
                except Exception as exc:
                    outcome = [type(exc).__name__, str(exc)[:400]]
                    break
            report[f"dead_{what}"] = outcome
        with open(os.path.join(ckpt_dir, "client.json"), "w") as fh:
            json.dump(report, fh)
    world.stop(timeout=5.0, graceful=False)  # the primary is dead: a graceful shutdown would wait it out


def after_world(rank: int, ckpt_dir: str) -> dict[str, Any]:
    """A rebuilt world: each reducer loads its checkpoint; the client pulls, pushes AFTER more."""
    torch.set_num_threads(1)
    from pc_distributed import get_world

    world = get_world()
    assert world is not None
    group = world.create_rpc_group("r", ["0", "1", "2"])
    impl, model = (
        _reducer(group, rank, os.path.join(ckpt_dir, f"{rank}.pt")) if rank in (0, 1) else (None, None)
    )
    out: dict[str, Any] = {}
    if impl is not None:
        out["version_at_load"] = impl.stats().version
    group.barrier(WAIT_S)
    if rank == 2:
        gs = group.get_paired("gs").to_here()
        out["accepted"], out["start_version"] = _push_and_wait(gs, AFTER, BEFORE + AFTER)
        out["client_id"] = gs.client_id
    group.barrier(WAIT_S)  # every push applied
    if impl is not None:
        impl.stop(timeout=WAIT_S)
        impl.watch()
    group.barrier(WAIT_S)  # every reducer stopped
    if rank == 2:
        ledger = gs.ledger()
        out["ledger"] = _ledger_json(ledger)
        out["mine_applied"] = ledger.clients[out["client_id"]].applied
    if model is not None:
        out["weights"] = model.weights()
        out["version"] = impl.stats().version if impl is not None else None
        out["last_epoch"] = impl.lr_scheduler.last_epoch if impl is not None else None
    group.barrier(WAIT_S)
    return out
