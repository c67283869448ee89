"""Asynchronous training of a small CNN on real data (handwritten digits) with all seven pc packages.

The data is scikit-learn's ``load_digits`` (1,797 8x8 images of the digits 0-9, shipped inside scikit-learn,
nothing downloaded): a fixed split of 1,437 training and 360 held-out images.

What runs where::

    parent: loads the digits, starts the world, trains the single-process baseline, prints a table, plots
      |
      | pc_distributed.run_world(world_size = 1 + workers)   (loopback, free ports, a timeout on everything)
      v
    rank 0  primary gradient reducer (pc_server.grad_server_helper): applies the reduced gradients with its
            optimizer and publishes each new model version
    rank 1.. workers: each
              - places the model's parts with pc_assigner.ModelAssigner and prints the placement,
              - converts BatchNorm with pc_sync.convert_model and runs it on two CPU thread replicas
                through pc_replicate.ReplicationCallbackDataParallel (batch statistics synchronized),
              - gets its batches from a pc_pool.Pool running a lambda (pickled by pc_pickle), the dataset
                and the batches shared through shared memory rather than copied,
              - pushes its gradients to the gradient server and pulls the newest model.

Run ``python examples/async_training.py --help`` for the flags; ``nox -s demo`` runs it with the defaults.
The script exits with status 1 when the held-out accuracy of the asynchronous run is below 0.95 or more than
2 points under the single-process baseline trained on the same number of samples. It saves a PNG of accuracy
and loss against time (asynchronous against baseline) and prints its path.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

import torch
from demo_report import Progress, print_table, save_plot
from digits_task import (
    Data,
    batch_of,
    batch_stat_accuracy,
    evaluate,
    load_data,
    make_model,
    recompute_bn_stats,
)
from torch import nn

EVAL_EVERY = 10  # steps between two points of the accuracy curve
MIN_ACCURACY = 0.95
MAX_GAP_TO_BASELINE = 0.02


@dataclasses.dataclass(frozen=True)
class Config:
    """The demo's settings (see ``--help``)."""

    workers: int = 2
    steps: int = 120
    batch_size: int = 64
    replicas: int = 2
    device: str = "cpu"
    lr: float = 0.05
    max_staleness: int | None = 4
    seed: int = 0
    timeout: float = 240.0
    progress: bool = True
    plot: str = "pc-demo-digits.png"


def parse_args(argv: list[str] | None = None) -> Config:
    """Parse the command line into a :class:`Config`."""
    p = argparse.ArgumentParser(
        description="Asynchronous training with pc: a gradient server, workers on synchronized CPU replicas, "
        "batches from a process pool, the model placed by the assigner.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--workers", type=int, default=2, help="number of worker processes (the world has one more)"
    )
    p.add_argument("--steps", type=int, default=120, help="optimisation steps (gradient pushes) per worker")
    p.add_argument(
        "--batch-size", type=int, default=64, help="samples per worker step (split across replicas)"
    )
    p.add_argument(
        "--replicas", type=int, default=2, help="thread replicas per worker (synchronized batch norm)"
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda", "auto"],
        default="cpu",
        help="where the workers compute: cpu (thread replicas), cuda (one GPU replica per visible device), "
        "or auto (cuda when available)",
    )
    p.add_argument("--lr", type=float, default=0.05, help="learning rate of the server's SGD optimizer")
    p.add_argument(
        "--max-staleness",
        type=int,
        default=4,
        help="drop gradients computed on a model more than this many versions old (-1: keep all)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the dataset, the model and the reducer choice"
    )
    p.add_argument("--timeout", type=float, default=240.0, help="seconds before the whole world is stopped")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.add_argument("--plot", default="pc-demo-digits.png", help="where to save the PNG ('' for none)")
    a = p.parse_args(argv)
    for name in ("workers", "steps", "batch_size", "replicas"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    device = a.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda was asked for but torch sees no CUDA device")
    return Config(
        workers=a.workers,
        steps=a.steps,
        batch_size=a.batch_size,
        replicas=a.replicas,
        device=device,
        lr=a.lr,
        max_staleness=None if a.max_staleness < 0 else a.max_staleness,
        seed=a.seed,
        timeout=a.timeout,
        progress=not a.no_progress,
        plot=a.plot,
    )


# --------------------------------------------------------------------------------------------------- the task
def baseline(
    cfg: Config, x: torch.Tensor, y: torch.Tensor, held_out: Data
) -> tuple[nn.Module, list[tuple[float, float, float]]]:
    """Single-process SGD on the same samples, in the same batch size, for the same number of updates.

    Returns the model and its curve: ``(seconds, training loss, held-out accuracy)`` every few steps.
    """
    torch.manual_seed(cfg.seed)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    curve: list[tuple[float, float, float]] = []
    start = time.perf_counter()
    for i in range(cfg.steps * cfg.workers):
        xb, yb = batch_of(x, y, i, cfg.batch_size)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        if i % (EVAL_EVERY * cfg.workers) == 0 or i == cfg.steps * cfg.workers - 1:
            curve.append((time.perf_counter() - start, loss.item(), batch_stat_accuracy(model, *held_out)))
    return model, curve


# ------------------------------------------------------------------------------------------------ the world
def run_rank(rank: int, cfg: Config, train: Data, held_out: Data) -> dict[str, Any]:
    """What every process of the world runs; rank 0 is the primary reducer, the others train."""
    import pc_server
    from pc_distributed import get_world
    from pc_server import GradLedger

    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    servers = pc_server.grad_server_helper(
        [make_model],
        group_name="grad_server",
        members="all",
        optimizer=torch.optim.SGD,
        learning_rate=cfg.lr,
        optimizer_kwargs={"momentum": 0.9},
        timeout=cfg.timeout,
        server_kwargs={"reduce_method": "mean", "reduce_batch_size": 1, "max_staleness": cfg.max_staleness},
    )
    (server,) = servers
    server.set_seed(cfg.seed + rank)
    done = get_world().create_rpc_group("demo_done", [str(r) for r in range(cfg.workers + 1)])
    try:
        result = {"rank": 0} if rank == 0 else train_worker(rank, cfg, server, train, held_out)
        done.barrier(cfg.timeout)  # the primary keeps serving until every worker is done
        servers.stop(timeout=30.0)  # all ranks at once: the primary waits for the secondaries to drain
        servers.watch()  # re-raise a reducer thread's error, if any
        result["ledger"] = GradLedger.merge(impl.ledger() for impl in servers.impls)
        if rank == 0:
            impl = servers.impls[0]
            result["steps"] = impl.stats().steps
            result["state_dict"] = {k: v.detach().cpu().clone() for k, v in impl.model.state_dict().items()}
        return result
    finally:
        servers.stop(timeout=10.0)
        done.destroy()


def train_worker(rank: int, cfg: Config, server: Any, train: Data, held_out: Data) -> dict[str, Any]:
    """One worker: placement, synchronized replicas, pooled batches, gradient pushes; records its curve."""
    import pc_assigner
    import pc_pool
    import pc_replicate
    import pc_sync

    model = make_model()
    if not server.pull(model):
        raise RuntimeError("could not pull the initial model from the gradient server")
    parts = list(model.children())
    assigner = pc_assigner.ModelAssigner(
        parts, {(0, 1): cfg.batch_size * 512}, devices=_devices(cfg), move_models=True, seed=cfg.seed
    )
    placement = [str(d) for d in assigner.assignment]
    model = pc_sync.convert_model(model)
    if cfg.device == "cuda":
        replica_ids: list[Any] = list(range(torch.cuda.device_count()))
        model.cuda()
        held_out = (held_out[0].cuda(), held_out[1].cuda())
    else:
        replica_ids = ["cpu"] * cfg.replicas
    dp = pc_replicate.ReplicationCallbackDataParallel(model, device_ids=replica_ids)
    x, y = train
    pushes = 0
    losses: list[float] = []
    curve: list[tuple[float, float, float]] = []
    progress = Progress(f"worker {rank}", cfg.steps, position=rank - 1, enabled=cfg.progress)
    start = time.perf_counter()
    # Batches come from a process pool running a lambda (pickled by pc_pickle); the dataset it closes over and
    # the batches it returns travel as shared-memory handles, not copies.
    with pc_pool.Pool(1, is_copy_tensor=False, share_method="cpu") as pool:
        indices = range(rank - 1, cfg.steps * cfg.workers, cfg.workers)  # this worker's share of the batches
        batches = pool.imap(lambda i: batch_of(x, y, i, cfg.batch_size), indices)
        for step in range(cfg.steps):
            xb, yb = next(batches)
            if cfg.device == "cuda":
                xb, yb = xb.cuda(), yb.cuda()
            model.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(dp(xb), yb)
            loss.backward()
            server.push(model)  # gradients to a secondary reducer, then the newest model back
            pushes += 1
            losses.append(loss.item())
            if step % EVAL_EVERY == 0 or step == cfg.steps - 1:
                seconds = time.perf_counter() - start
                curve.append((seconds, loss.item(), batch_stat_accuracy(model, *held_out)))
            progress.update(loss.item())
    progress.close()
    return {
        "rank": rank,
        "placement": placement,
        "pushes": pushes,
        "first_loss": losses[0],
        "last_loss": sum(losses[-5:]) / len(losses[-5:]),
        "seconds": time.perf_counter() - start,
        "samples": cfg.steps * cfg.batch_size,
        "curve": curve,
    }


def _devices(cfg: Config) -> list[str]:
    if cfg.device == "cuda":
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())] + ["cpu"]
    return ["cpu"]


# -------------------------------------------------------------------------------------------- the summary
def report(
    cfg: Config, results: list[dict[str, Any]], train: Data, held_out: Data, base: nn.Module
) -> tuple[bool, float, float]:
    """Print the placement and the summary table; return (passed, accuracy, baseline accuracy)."""
    primary, workers = results[0], results[1:]
    print(f"\nplacement of the model's parts (features, head): {workers[0]['placement']}")
    model = make_model()
    model.load_state_dict(primary["state_dict"])
    # A gradient server exchanges gradients, not buffers: the server's batch-norm running statistics were
    # never updated. Recompute them on training batches before evaluating (like swa_utils.update_bn).
    recompute_bn_stats(model, train, cfg.batch_size)
    loss, accuracy = evaluate(model, *held_out)
    base_loss, base_accuracy = evaluate(base, *held_out)
    _, initial_accuracy = evaluate(_initial_model(cfg), *held_out)
    from pc_server import GradLedger

    ledger = GradLedger.merge(r["ledger"] for r in results).total
    samples = sum(w["samples"] for w in workers)
    seconds = max(w["seconds"] for w in workers)
    rows = [
        ("workers x replicas", f"{cfg.workers} x {cfg.replicas} ({cfg.device})"),
        ("steps (pushes) per worker", str(cfg.steps)),
        ("pushes in all", str(sum(w["pushes"] for w in workers))),
        ("ledger: accepted / refused as stale", f"{ledger.accepted} / {ledger.refused_stale}"),
        ("ledger: applied / dropped", f"{ledger.applied} / {ledger.dropped}"),
        ("optimizer steps on the server", str(primary["steps"])),
        ("held-out accuracy: initial model", f"{initial_accuracy:.4f}"),
        ("held-out accuracy: pc, asynchronous", f"{accuracy:.4f}"),
        ("held-out accuracy: single-process baseline", f"{base_accuracy:.4f}"),
        ("held-out loss: pc / baseline", f"{loss:.4f} / {base_loss:.4f}"),
        ("throughput (samples/s, all workers)", f"{samples / seconds:.0f}"),
    ]
    print_table(rows)
    balanced = ledger.accepted == ledger.applied + ledger.dropped
    if not balanced:
        print(f"\nLEDGER DOES NOT BALANCE: {ledger}", flush=True)
    passed = balanced and accuracy >= MIN_ACCURACY and accuracy >= base_accuracy - MAX_GAP_TO_BASELINE
    if passed:
        print("\nconverged", flush=True)
    else:
        print(
            f"\nDID NOT CONVERGE: accuracy {accuracy:.4f} (needs >= {MIN_ACCURACY} and within "
            f"{MAX_GAP_TO_BASELINE:.2f} of the baseline's {base_accuracy:.4f})",
            flush=True,
        )
    return passed, accuracy, base_accuracy


def _initial_model(cfg: Config) -> nn.Module:
    torch.manual_seed(cfg.seed)
    return make_model()


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit status."""
    from pc_distributed import run_world

    cfg = parse_args(argv)
    torch.set_num_threads(1)
    train, held_out = load_data(cfg.seed)
    for t in train:
        t.share_memory_()
    print(
        f"pc demo: digits ({len(train[1])} training / {len(held_out[1])} held-out images), "
        f"{cfg.workers} workers + 1 gradient server, {cfg.steps} steps each, pid {os.getpid()}"
    )
    start = time.perf_counter()
    results = run_world(run_rank, cfg.workers + 1, args=(cfg, train, held_out), timeout=cfg.timeout)
    print(f"world finished in {time.perf_counter() - start:.1f} s")
    base, base_curve = baseline(cfg, *train, held_out)
    passed, _, _ = report(cfg, results, train, held_out, base)
    if cfg.plot:
        curves = {f"pc worker {w['rank']}": w["curve"] for w in results[1:]}
        curves["single-process baseline"] = base_curve
        print(f"plot saved to {save_plot(cfg.plot, curves)}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
