"""pc-sync benchmarks: SyncMaster round latency and synchronized batch norm on CPU thread replicas.

Measured side by side in one run (medians; ratios against the baseline row of each case):

1. one SyncMaster round with 2/4/8 participants, against a re-implementation of the anchors' protocol
   (Synchronized-BatchNorm-PyTorch / Jacinle ``comm.py``: a Queue, an ``if``-based FutureResult and one
   acknowledgement per slave on the shared queue) -- the original packages are not installable here;
2. forward + backward of ``SynchronizedBatchNorm2d`` on 2 and 4 CPU thread replicas
   (``pc_replicate.ReplicationCallbackDataParallel``) against ``nn.BatchNorm2d`` on the same replicas (the
   unsynchronized baseline of the issue's target) and ``nn.BatchNorm2d`` on the full batch in one thread, in
   process CPU time (all threads; min of interleaved rounds) and in wall time (medians);
3. the fixed cost per layer call, on a tiny input where the arithmetic is negligible: a SyncBN step and a
   plain BN step on the same replicas, the replica apply alone (on threads kept between calls, as
   ReplicationCallbackDataParallel does), and starting + joining as many threads;
4. the non-parallel and eval paths against ``nn.BatchNorm2d`` (CPU time of the calling thread);
5. bytes saved for backward, relative to the input's size;
   (also) one layer's exchange round on 2 and 4 replica threads against a bare hand-off of the same messages
   and a ``threading.Barrier`` exchange (``exchange_round.py``);
6. the launch budget (``op_count.py``): the ops one synchronized layer issues per replica per training step,
   on the composite CPU path and on the CUDA path's fused kernels (their pure-torch stand-ins, each kernel
   call one op), beside plain ``nn.BatchNorm2d`` on the same replicas.

torch's intra-op threads: ``torch.set_num_threads(1)`` for every variant alike (the replica threads of
pc_replicate re-apply the caller's setting), so each replica runs its ops on one core and the two sides do the
same work per core.

Run: ``python packages/pc-sync/benchmarks/run.py [--quick] [--out results.json]``.
"""

from __future__ import annotations

import contextlib
import pathlib
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
from benchlib import Report, bench_args, interleaved_min, median_time
from exchange_round import BASELINE as EXCHANGE_BASELINE
from exchange_round import exchange_round_us
from op_count import count_layer_ops

from pc_replicate import ReplicationCallbackDataParallel
from pc_replicate._apply import apply_replicas
from pc_replicate._pool import ReplicaThreads
from pc_sync import SynchronizedBatchNorm2d, SyncMaster

# --------------------------------------------------------------------------------- the anchors' protocol


class _AnchorFutureResult:
    """The anchors' FutureResult: ``if`` instead of ``while``, ``None`` means empty, no timeout."""

    def __init__(self) -> None:
        self._result: Any = None
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)

    def put(self, result: Any) -> None:
        with self._lock:
            self._result = result
            self._cond.notify()

    def get(self) -> Any:
        with self._lock:
            if self._result is None:
                self._cond.wait()
            res, self._result = self._result, None
            return res


class _AnchorMaster:
    """The anchors' SyncMaster: results are acknowledged on the shared queue (one ack per slave)."""

    def __init__(self, callback: Callable[[list[tuple[int, Any]]], list[tuple[int, Any]]]) -> None:
        self._callback = callback
        self._queue: queue.Queue[Any] = queue.Queue()
        self._registry: dict[int, _AnchorFutureResult] = {}

    def register_slave(self, identifier: int) -> Callable[[Any], Any]:
        future = _AnchorFutureResult()
        self._registry[identifier] = future

        def run_slave(msg: Any) -> Any:
            self._queue.put((identifier, msg))
            ret = future.get()
            self._queue.put(True)
            return ret

        return run_slave

    def run_master(self, msg: Any) -> Any:
        intermediates = [(0, msg)]
        for _ in range(len(self._registry)):
            intermediates.append(self._queue.get())
        results = self._callback(intermediates)
        for i, res in results:
            if i != 0:
                self._registry[i].put(res)
        for _ in range(len(self._registry)):
            assert self._queue.get() is True
        return results[0][1]


def _echo(msgs: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    return [(ident, m) for ident, m in msgs]


def _round_latency(participants: int, rounds: int, anchor: bool) -> float:
    """Seconds per round, with ``participants - 1`` slave threads doing ``rounds`` rounds."""
    if anchor:
        amaster = _AnchorMaster(_echo)
        slaves = [amaster.register_slave(i) for i in range(1, participants)]
        run_master: Callable[[Any], Any] = amaster.run_master
    else:
        master = SyncMaster(_echo)
        pipes = [master.register_slave(i) for i in range(1, participants)]
        slaves = [lambda m, p=p: p.run_slave(m, timeout=60.0) for p in pipes]

        def run_master(m: Any) -> Any:
            return master.run_master(m, timeout=60.0)

    threads = [
        threading.Thread(target=lambda s=s: [s(r + 1) for r in range(rounds)], daemon=True) for s in slaves
    ]
    for t in threads:
        t.start()
    start = time.perf_counter()
    for r in range(rounds):
        run_master(r + 1)
    elapsed = time.perf_counter() - start
    for t in threads:
        t.join(60.0)
    return elapsed / rounds


# ------------------------------------------------------------------------------------------ batch norm


def _step(module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        x.grad = None
        module.zero_grad(set_to_none=True)
        (module(x) * g).sum().backward()

    return run


def _saved_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward of ``module(x)``."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


def _saved_bytes_replica0(n: int, x: torch.Tensor) -> float:
    """Saved-for-backward bytes of replica 0 of ``n`` SyncBN replicas, relative to its chunk's bytes.

    Saved-tensor hooks are thread-local, so replica 0 runs in this thread and the others in threads.
    """
    dp = ReplicationCallbackDataParallel(SynchronizedBatchNorm2d(x.shape[1]), device_ids=["cpu"] * n)
    replicas = dp.replicate(dp.module, dp.device_ids)
    chunks = [c.detach().clone().requires_grad_() for c in x.chunk(n)]
    threads = [
        threading.Thread(target=replicas[i], args=(chunks[i],), daemon=True) for i in range(1, len(chunks))
    ]
    for t in threads:
        t.start()
    saved = _saved_bytes(replicas[0], chunks[0])
    for t in threads:
        t.join(60.0)
    return saved / (chunks[0].numel() * chunks[0].element_size())


def _interleaved(fns: list[Callable[[], Any]], repeat: int, warmup: int = 2) -> list[float]:
    """Median seconds of each function, timed round-robin so that machine noise hits all of them alike."""
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            samples[i].append(median_time(fn, repeat=1, warmup=warmup if not samples[i] else 0))
    return [statistics.median(s) for s in samples]


def _fixed_costs(report: Report, repeat: int) -> None:
    """Per layer call, on an 8x8x2x2 input (negligible arithmetic): what replication and the sync cost."""
    with contextlib.ExitStack() as stack:
        _measure_fixed_costs(report, repeat, stack)


def _measure_fixed_costs(report: Report, repeat: int, stack: contextlib.ExitStack) -> None:
    x = torch.randn(8, 8, 2, 2).requires_grad_()
    g = torch.randn_like(x)
    fns: dict[str, Callable[[], Any]] = {}
    for n in (2, 4):
        fns[f"SyncBN2d step, {n} replicas"] = _step(
            ReplicationCallbackDataParallel(SynchronizedBatchNorm2d(8), device_ids=["cpu"] * n), x, g
        )
        fns[f"BatchNorm2d step, {n} replicas"] = _step(
            ReplicationCallbackDataParallel(nn.BatchNorm2d(8), device_ids=["cpu"] * n), x, g
        )
        identities = [nn.Identity() for _ in range(n)]
        pool = ReplicaThreads()  # kept between calls, as ReplicationCallbackDataParallel keeps its own
        stack.callback(pool.close)
        fns[f"replica apply alone, {n} replicas"] = lambda m=identities, p=pool: apply_replicas(
            m, [(torch.zeros(1),)] * len(m), threads=p
        )

        def start_join(n: int = n) -> None:
            threads = [threading.Thread(target=int) for _ in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60.0)

        fns[f"start + join {n} threads"] = start_join
    fns["BatchNorm2d step, no replication"] = _step(nn.BatchNorm2d(8), x, g)
    cpu = interleaved_min(fns, repeat, number=20, clock=time.process_time)
    for n in (2, 4):
        case = f"fixed cost per layer call, {n} replicas (CPU time)"
        for name in (
            f"SyncBN2d step, {n} replicas",
            f"BatchNorm2d step, {n} replicas",
            f"replica apply alone, {n} replicas",
            f"start + join {n} threads",
        ):
            report.row(case, name, cpu[name] * 1e6, "us", baseline=name.startswith("BatchNorm2d"))
    report.row(
        "fixed cost per layer call, no replication (CPU time)",
        "BatchNorm2d step",
        cpu["BatchNorm2d step, no replication"] * 1e6,
        "us",
        baseline=True,
    )


EXCHANGE_TARGET = 1.3  # the previous SyncMaster (per-slave Condition slots) measured 1.4x at 4 replicas


def _exchange_rounds(report: Report, rounds: int, repeat: int) -> None:
    """One layer's exchange round on 2 and 4 replica threads, beside a bare hand-off of the same messages."""
    for n in (2, 4):
        us, ratios = exchange_round_us(n, rounds, repeat)
        case = f"exchange round per layer, {n} replicas"
        for name, value in us.items():
            report.row(case, name, value, "us", baseline=name == EXCHANGE_BASELINE)
        ratio = ratios["pc_sync.SyncMaster"]
        report.target(
            f"(exchange) SyncMaster round / bare hand-off, {n} replicas",
            ratio,
            "<=",
            EXCHANGE_TARGET,
            note=""
            if ratio <= EXCHANGE_TARGET
            else "the round's checks (ids, replies, timeouts, abort) cost more than the hand-off they guard; "
            "profile with python packages/pc-sync/benchmarks/exchange_round.py",
        )
    report.note(
        "exchange round per layer: the messages of a tiny SyncBN layer, one shared reply, no arithmetic; "
        "wall medians of interleaved repeats; the target is the median of the per-repeat ratios to the bare "
        "hand-off (a queue in, one lock per replica out, nothing checked: the floor of a master/slave "
        "exchange on Python threads), which the thread wake-ups dominate"
    )


def _launch_budget(report: Report) -> None:
    """Ops per replica per training step of one layer (see ``op_count.py``): a count, not a timing."""
    per_replica: dict[int, dict[str, float]] = {}
    for n in (2, 4):
        case = f"ops per replica per training step, {n} replicas"
        counts = {
            kind: sum(count_layer_ops(kind, n).values()) / n for kind in ("plain", "composite", "fused")
        }
        per_replica[n] = counts
        report.row(case, "BatchNorm2d (no sync)", counts["plain"], "ops", baseline=True)
        report.row(case, "SyncBN2d, composite path (CPU)", counts["composite"], "ops")
        report.row(case, "SyncBN2d, fused path (CUDA's, stand-ins)", counts["fused"], "ops")
    fused = per_replica[2]["fused"]
    report.target(
        "(issue 45) fused path: ops per replica per training step, 2 replicas",
        fused,
        "<=",
        10.0,
        "ops",
        note=""
        if fused <= 10.0
        else "see the op counts per name: python packages/pc-sync/benchmarks/op_count.py",
    )
    report.note(
        "launch budget: ops dispatched by one layer's training step on CPU thread replicas (forward in the "
        "replica threads, backward from the replicas' outputs to their inputs), views and bare allocations "
        "not counted; the fused path runs on the stand-ins of torch's five batch-norm kernels, each call one "
        "op; the count is the same on any machine"
    )


def main() -> None:
    args = bench_args("pc-sync")
    report = Report("pc-sync")
    torch.set_num_threads(1)
    report.note("torch.set_num_threads(1); CPU thread replicas via pc_replicate; medians of repeated runs")
    rounds = 300 if args.quick else 2000
    repeat = 5 if args.quick else 9

    latencies: dict[int, float] = {}
    for n in tqdm([2, 4, 8], desc="round latency", leave=False):
        case = f"one round, {n} participants"
        ours_samples: list[float] = []
        anchor_samples: list[float] = []
        try:
            for _ in range(repeat):
                ours_samples.append(_round_latency(n, rounds, False))
                anchor_samples.append(_round_latency(n, rounds, True))
        except AssertionError:
            ours = latencies[n] = min(
                ours_samples + [_round_latency(n, rounds, False) for _ in range(repeat)]
            )
            # the anchors' known ack race: a slave's next message arrives where the master expects an ack
            report.note(
                f"anchor protocol failed at {n} participants (AssertionError: ack race, as documented)"
            )
            report.row(case, "pc_sync.SyncMaster", ours * 1e6, "us")
            continue
        ours = latencies[n] = min(ours_samples)
        anchor = min(anchor_samples)
        report.row(case, "pc_sync.SyncMaster", ours * 1e6, "us")
        report.row(case, "anchor protocol (acks)", anchor * 1e6, "us", baseline=True)
    report.note("round latency: best of the repeats (the least disturbed by other processes on the machine)")
    report.target("(issue) one round, 4 participants", latencies[4] * 1e6, "<=", 100.0, "us")
    report.target("(design) one round, 4 participants", latencies[4] * 1e6, "<=", 50.0, "us")
    report.target("(design) one round, 8 participants", latencies[8] * 1e6, "<=", 100.0, "us")
    _exchange_rounds(report, rounds, repeat=5 if args.quick else 15)

    shapes = [(16, 32, 14, 14)] if args.quick else [(32, 64, 28, 28), (64, 256, 14, 14)]
    bn_repeat = 5 if args.quick else 20
    for shape in tqdm(shapes, desc="batch norm", leave=False):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(shape, generator=gen).requires_grad_()
        g = torch.randn(shape, generator=gen)
        label = "x".join(map(str, shape))
        full_step = _step(nn.BatchNorm2d(shape[1]), x, g)
        for n in (2, 4):
            case = f"fwd+bwd {label}, {n} replicas"
            plain_dp = ReplicationCallbackDataParallel(nn.BatchNorm2d(shape[1]), device_ids=["cpu"] * n)
            sync_dp = ReplicationCallbackDataParallel(
                SynchronizedBatchNorm2d(shape[1]), device_ids=["cpu"] * n
            )
            steps = {"sync": _step(sync_dp, x, g), "plain": _step(plain_dp, x, g), "full": full_step}
            cpu = interleaved_min(steps, bn_repeat, number=2, clock=time.process_time)
            t_sync, t_plain, full = _interleaved(list(steps.values()), repeat=bn_repeat)
            report.row(case, "SyncBN2d, replicas (CPU time)", cpu["sync"])
            report.row(case, "BatchNorm2d, replicas (CPU time)", cpu["plain"], baseline=True)
            report.row(case, "BatchNorm2d, full batch (CPU time)", cpu["full"])
            report.row(f"{case}, wall", "SyncBN2d, replicas", t_sync)
            report.row(f"{case}, wall", "BatchNorm2d, replicas", t_plain, baseline=True)
            report.row(f"{case}, wall", "BatchNorm2d, full batch", full)
            ratio_plain, ratio_full = cpu["sync"] / cpu["plain"], cpu["sync"] / cpu["full"]
            extra_ms = (cpu["sync"] - cpu["plain"]) * 1e3
            report.target(
                f"(issue) SyncBN / plain BN, same {n} replicas, {label}",
                ratio_plain,
                "<=",
                1.3,
                note=(
                    f"SyncBN's extra CPU per step here is {extra_ms:.2f} ms on {n} replicas: the per-channel "
                    "statistics, the master's combination and their backward nodes run as small torch ops "
                    "from Python once per replica, a cost that does not shrink with the input (the 'fixed "
                    "cost per layer call' rows measure it on an 8x8x2x2 input); the plain BN step it is "
                    "divided by no longer starts a thread per replica (kept replica threads), which took the "
                    "same amount off both sides and so raised the ratio"
                )
                if ratio_plain > 1.3
                else "",
            )
            if n == 4:
                report.target(f"(design) SyncBN 4 replicas / full-batch BN, {label}", ratio_full, "<=", 3.5)

        case = f"no replication {label}"
        ours_bn, torch_bn = SynchronizedBatchNorm2d(shape[1]), nn.BatchNorm2d(shape[1])
        # A second BatchNorm2d measured alike is the A/A control: outside a replica SyncBN runs the parent's
        # forward itself, so the control's ratio is the noise floor of this comparison on this machine.
        single = interleaved_min(
            {
                "ours": _step(ours_bn, x, g),
                "torch": _step(torch_bn, x, g),
                "control": _step(nn.BatchNorm2d(shape[1]), x, g),
            },
            bn_repeat * 2,
            number=2,
            clock=time.thread_time,
        )
        t_ours, t_torch = single["ours"], single["torch"]
        report.row(case, "SyncBN2d (train, CPU time)", t_ours)
        report.row(case, "BatchNorm2d (train, CPU time)", t_torch, baseline=True)
        report.row(case, "a second BatchNorm2d (A/A control, CPU time)", single["control"])
        ours_bn.eval()
        torch_bn.eval()
        with torch.no_grad():
            t_ours_eval, t_torch_eval = _interleaved(
                [lambda m=ours_bn, x=x: m(x), lambda m=torch_bn, x=x: m(x)], repeat=bn_repeat * 5
            )
        case = f"eval {label}"
        report.row(case, "SyncBN2d (eval)", t_ours_eval)
        report.row(case, "BatchNorm2d (eval)", t_torch_eval, baseline=True)
        control = single["control"] / t_torch
        report.target(
            f"(design) non-parallel train step vs BN, {label}",
            t_ours / t_torch,
            "<=",
            1.05,
            note=f"outside a replica SyncBN2d runs BatchNorm2d's own forward; the A/A control (a second "
            f"BatchNorm2d, same rounds) measured {control:.3f}x, the noise floor here"
            if t_ours / t_torch > 1.05
            else "",
        )

        input_bytes = x.numel() * x.element_size()
        saved_ours = _saved_bytes_replica0(4, x.detach())
        saved_torch = _saved_bytes(nn.BatchNorm2d(shape[1]), x) / input_bytes
        case = f"saved for backward / input {label}"
        report.row(case, "SyncBN2d, replica 0 of 4", saved_ours, "x")
        report.row(case, "BatchNorm2d, full batch", saved_torch, "x", baseline=True)
        report.target(f"(design) saved for backward / input, {label}", saved_ours, "<=", 2.0)

    _fixed_costs(report, repeat=5 if args.quick else 15)
    _launch_budget(report)
    report.note(
        "BN rows and the issue's SyncBN target: process CPU time of all threads (min of interleaved rounds), "
        "because 2 cores shared with other jobs make wall times of 2-4 threads swing 2x between rounds; wall "
        "medians are reported beside them"
    )
    report.note(
        "not measured here (no GPU): CUDA DataParallel step overhead and torch.nn.SyncBatchNorm under DDP; "
        "run the gpu nox session on a multi-GPU machine"
    )
    report.finish(args)


if __name__ == "__main__":
    main()
