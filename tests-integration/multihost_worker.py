"""The worker that test_integration_multihost.py starts under torchrun on every simulated host.

``python multihost_worker.py <scenario> <out_dir> [checks]``; each rank writes what it observed as JSON to
``<out_dir>/rank<r>.json`` (and, for the fault scenarios, ``<out_dir>/started<r>`` once torch is imported and
``<out_dir>/ready<r>`` once warmed up; it then waits for the test to write ``<out_dir>/go`` after it injected
the fault). Times are measured with a monotonic clock
and reported, never checked here.

Scenarios:
    basic: World, a world-wide and a cross-host collective group, an RPC group (rpc_sync, pair, register,
        barrier), the training checks of multihost_checks.py named in ``checks`` (comma-separated:
        data_parallel, daso, grad_server), then stop.
    fault: warm up, wait for ``go``, then rpc_sync(timeout=CALL) to the same local rank on the next host and
        an all_reduce (group timeout CALL), a ``pair`` and a ``barrier(timeout=CALL)``; record what each
        raised and how long it took, then World.stop().
    elastic: under ``torchrun --max_restarts=1``: DataParallel trains ELASTIC_STEPS steps; after
        ELASTIC_CHECKPOINT steps rank 0 saves model and optimizer to ``<out_dir>/ckpt.pt``, every rank writes
        ``checkpointed<r>`` and waits for ``go`` (the test kills one host's workers first); the restarted
        workers resume from the checkpoint and finish.
    heal: the same with HEAL_CALL; each rank writes ``calling<r>`` before its calls (the test heals the
        partition once all have), and the calls are expected to complete.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from multihost_checks import (
    ELASTIC_B,
    ELASTIC_CHECKPOINT,
    ELASTIC_STEPS,
    elastic_batches,
    elastic_loss,
    elastic_net,
    elastic_sgd,
    run_checks,
)

from pc_distributed import DataParallel, DataParallelOptimizer, World

CALL = 3.0  # seconds of the faulted rpc_sync and all_reduce
HEAL_CALL = 60.0  # the same, in the scenario whose partition heals before the timeout
DIST_TIMEOUT = 10.0  # the World's store/rendezvous timeout (the ranks start together: _start_together)
STOP = 3.0  # World.stop(timeout=...)
ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "TORCHELASTIC_RESTART_COUNT",
    "PC_MH_HOST",
)


def whoami(tag: str) -> str:
    """Return where this ran: ``tag@host<GROUP_RANK>:rank<RANK>:ns<namespace>`` (called through RPC)."""
    return f"{tag}@host{os.environ['GROUP_RANK']}:rank{os.environ['RANK']}:ns{os.environ['PC_MH_HOST']}"


def _echo(x: Any) -> Any:
    return x


def _write(out: Path, rank: int, obs: dict[str, Any]) -> None:
    tmp = out / f".rank{rank}.json"
    tmp.write_text(json.dumps(obs))
    tmp.replace(out / f"rank{rank}.json")


def basic(out: Path, checks: list[str]) -> None:
    """World, collectives and RPC across hosts, then the training checks (multihost_checks.py)."""
    rank = int(os.environ["RANK"])
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    world = World(name=f"w{rank}", dist_timeout=60, rpc_timeout=60)
    obs: dict[str, Any] = {"env": {k: os.environ.get(k) for k in ENV_KEYS}}
    obs["rank"], obs["world_size"] = world.rank, world.world_size
    obs["members"] = world.get_members()
    obs["name_of"] = [world.name_of(r) for r in world.get_ranks()]
    size = world.world_size
    everyone = world.create_collective_group(list(range(size)), timeout=60)
    t = torch.tensor([float(rank + 1)])
    everyone.all_reduce(t)
    obs["all_reduce"] = t.item()
    # A sub-group of one rank on each of the first two hosts: host 0's last local rank, host 1's first.
    cross = world.create_collective_group([local - 1, local], timeout=60)
    if cross.is_member():
        u = torch.tensor([float(10 * rank)])
        cross.all_reduce(u)
        obs["cross_all_reduce"] = u.item()
    gathered = [torch.zeros(1) for _ in range(size)]
    everyone.all_gather(gathered, torch.tensor([float(rank)]))
    obs["all_gather"] = [g.item() for g in gathered]
    group = world.create_rpc_group("g", world.get_members())
    peer = (rank + local) % size  # the same local rank on the next host
    obs["rpc_sync"] = group.rpc_sync(f"w{peer}", whoami, args=("hi",), timeout=30)
    group.pair(f"value{rank}", {"from": rank})
    group.register(f"svc{rank}", _echo)
    group.barrier(timeout=60)
    obs["get_paired"] = group.get_paired(f"value{peer}").to_here()
    obs["registered_sync"] = group.registered_sync(f"svc{peer}", args=(rank,), timeout=30)
    group.barrier(timeout=60)
    obs["checks"] = run_checks(rank, size, group, checks)
    start = time.monotonic()
    world.stop(timeout=30)
    obs["stop_s"] = time.monotonic() - start
    _write(out, rank, obs)


def _timed(fn: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        result = fn()
        return {"ok": True, "result": repr(result), "s": time.monotonic() - start}
    except BaseException as exc:  # recorded for the test
        return {
            "ok": False,
            "error": type(exc).__name__,
            "message": str(exc)[:300],
            "s": time.monotonic() - start,
        }


def _start_together(out: Path, rank: int, size: int) -> None:
    """Wait until every rank has imported torch (files on the shared file system), so that the short
    ``DIST_TIMEOUT`` bounds the World's rendezvous and not the start-up skew of a loaded machine."""
    (out / f"started{rank}").write_text("1")
    deadline = time.monotonic() + 150
    while not all((out / f"started{r}").exists() for r in range(size)):
        if time.monotonic() > deadline:
            raise SystemExit("the other ranks did not start in 150 s")
        time.sleep(0.05)


def fault(out: Path, call: float = CALL) -> None:
    """Warm up, wait for the test's fault, then call across hosts and stop (every step timed)."""
    rank = int(os.environ["RANK"])
    size = int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    _start_together(out, rank, size)
    world = World(name=f"w{rank}", dist_timeout=DIST_TIMEOUT, rpc_timeout=call)
    everyone = world.create_collective_group(list(range(size)), timeout=call)
    group = world.create_rpc_group("g", world.get_members())
    peer = f"w{(rank + local) % size}"
    warm = torch.ones(1)
    everyone.all_reduce(warm)
    group.rpc_sync(peer, whoami, args=("warm",), timeout=30)
    group.barrier(timeout=60)
    (out / f"ready{rank}").write_text("1")
    deadline = time.monotonic() + 120
    while not (out / "go").exists():  # the test writes go after injecting the fault
        if time.monotonic() > deadline:
            raise SystemExit("no go from the test in 120 s")
        time.sleep(0.05)
    obs: dict[str, Any] = {"rank": rank, "t_go": time.time()}
    (out / f"calling{rank}").write_text("1")
    obs["rpc_sync"] = _timed(lambda: group.rpc_sync(peer, whoami, args=("fault",), timeout=call))
    total = torch.ones(1)
    obs["all_reduce"] = _timed(lambda: everyone.all_reduce(total))
    obs["all_reduce_value"] = total.item()
    # Store requests: a claim (a short request, bounded by DIST_TIMEOUT), a barrier (a wait, bounded by call).
    obs["pair"] = _timed(lambda: group.pair(f"after{rank}", rank))
    obs["barrier"] = _timed(lambda: group.barrier(timeout=call))
    _write(out, rank, obs)
    if os.environ.get("PC_MH_DUMP"):
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["PC_MH_DUMP"]), repeat=True)
    obs["stop"] = _timed(lambda: world.stop(timeout=STOP))
    _write(out, rank, obs)
    sys.stdout.flush()
    os._exit(0)  # leave at once: torch's atexit handlers could wait on the lost peers


def elastic(out: Path) -> None:
    """Train with DataParallel; checkpoint; (first attempt) wait to be killed; (restart) resume and finish."""
    rank = int(os.environ["RANK"])
    size = int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    world = World(name=f"w{rank}", dist_timeout=60, rpc_timeout=30)  # the hosts restart seconds apart
    ckpt = out / "ckpt.pt"
    net = elastic_net(rank)
    sgd = elastic_sgd(net)
    start = 0
    if ckpt.exists():  # every rank resumes from what rank 0 saved (the hosts share this path)
        state = torch.load(ckpt)
        net.load_state_dict(state["model"])
        sgd.load_state_dict(state["optimizer"])  # momentum buffers: every rank needs them
        start = state["step"]
    opt = DataParallelOptimizer(sgd)
    dp = DataParallel(net, optimizer=opt, blocking_parameter_updates=True)
    obs: dict[str, Any] = {"rank": rank, "attempt": attempt, "start": start, "t_resumed": time.time()}
    _write(out, rank, obs)  # the test sees every attempt begin
    batches = elastic_batches(size)
    sl = slice(rank * ELASTIC_B, (rank + 1) * ELASTIC_B)
    for step in range(start, ELASTIC_STEPS):
        x, y, u = batches[step]
        opt.zero_grad()
        elastic_loss(dp(x[sl]), y[sl], u[sl]).backward()
        opt.step()
        if step + 1 == ELASTIC_CHECKPOINT and attempt == 0:
            if rank == 0:
                tmp = out / ".ckpt.pt"
                torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(), "step": step + 1}, tmp)
                tmp.replace(ckpt)  # atomic: a restart never reads half a checkpoint
            world.create_collective_group(list(range(size)), timeout=60).barrier()
            (out / f"checkpointed{rank}").write_text("1")  # the test's trigger: the kill follows
            deadline = time.monotonic() + 120
            while not (out / "go").exists():  # written after the kill: host 1 dies here, host 0 goes on
                if time.monotonic() > deadline:
                    raise SystemExit("no go from the test in 120 s")
                time.sleep(0.05)
    obs["params"] = [p.detach().reshape(-1).tolist() for p in net.parameters()]
    obs["t_done"] = time.time()
    obs["done"] = True
    world.stop(timeout=30)
    _write(out, rank, obs)


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    if scenario == "heal":
        fault(out, HEAL_CALL)
    elif scenario == "basic":
        basic(out, sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] else [])
    else:
        {"fault": fault, "elastic": elastic}[scenario](out)


if __name__ == "__main__":
    main()
