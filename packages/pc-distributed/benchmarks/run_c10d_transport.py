"""The c10d transport against raw point-to-point ops and TensorPipe RPC, in one two-rank world.

Cases (rank 0 calls, rank 1 serves; gloo and TensorPipe on loopback):
- small call: ``C10dTransport.call_sync`` of an echo of a 16-float tensor, against TensorPipe's
  ``rpc.rpc_sync`` with TCP only (the World's default: no busy-polling shared-memory transport) and against
  a raw ``dist.send``/``dist.recv`` round trip of the same tensor on the transport's own gloo group;
- 4 MB tensor: the same three with a 4 MB float tensor each way (throughput = bytes moved / time).

The variants run interleaved (ours, the peers, the peers, ours, ...) and are compared by medians in the same
run: the machine is shared and noisy. Targets (from the c10d backend's issue): a small call at most 1.0x
TensorPipe's, and 4 MB at least 0.8x the raw send/recv bandwidth. Usage:
``python run_c10d_transport.py [--quick] [--out results.json]``.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
from benchlib import Report, bench_args

import pc_distributed as pd
from pc_distributed.rpc._c10d_transport import C10dTransport

_VARIANTS = ("c10d", "tensorpipe", "raw")
_RAW_TAG = 7  # the raw round trips' tag on the transport's group (the transport uses its own tags)


def echo(x: Any) -> Any:
    return x


def _raw_round_trip(rank: int, tensor: torch.Tensor, group: Any) -> None:
    if rank == 0:
        dist.send(tensor, 1, group=group, tag=_RAW_TAG)
        dist.recv(tensor, 1, group=group, tag=_RAW_TAG)
    else:
        dist.recv(tensor, 0, group=group, tag=_RAW_TAG)
        dist.send(tensor, 0, group=group, tag=_RAW_TAG)


def _bench(rank: int, quick: bool) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    group = dist.new_group([0, 1], timeout=timedelta(seconds=60))
    transport = C10dTransport(group, rank, ["0", "1"], timeout=60, group_timeout=60)
    rounds = 5 if quick else 9
    out: dict[str, dict[str, float]] = {}
    try:
        for case, numel, number in (("small", 16, 20 if quick else 60), ("4 MB", 1 << 20, 3 if quick else 8)):
            payload = torch.ones(numel)
            calls = {
                "c10d": lambda p=payload: transport.call_sync(1, echo, (p,)),
                "tensorpipe": lambda p=payload: rpc.rpc_sync("1", echo, args=(p,)),
                "raw": lambda p=payload: _raw_round_trip(0, p, group),
            }
            samples: dict[str, list[float]] = {v: [] for v in _VARIANTS}
            for r in range(rounds + 1):  # round 0 warms up
                order = _VARIANTS if r % 2 == 0 else _VARIANTS[::-1]
                for variant in order:
                    if rank == 1:  # rank 1 serves; for the raw round trips it must take part
                        if variant == "raw":
                            for _ in range(number):
                                _raw_round_trip(1, payload, group)
                        continue
                    start = time.perf_counter()
                    for _ in range(number):
                        calls[variant]()
                    if r:
                        samples[variant].append((time.perf_counter() - start) / number)
            if rank == 0:
                out[case] = {v: statistics.median(s) for v, s in samples.items()}
        dist.barrier(group=group)  # both ranks are done measuring before the goodbyes
    finally:
        transport.shutdown(timeout=30)
    return out


def main() -> None:
    args = bench_args("pc-distributed")
    report = Report("pc-distributed")
    started = time.perf_counter()
    times = pd.run_world(_bench, 2, args=(args.quick,), timeout=600)[0]
    small, big = times["small"], times["4 MB"]
    case = "call round trip, 64 B tensor (c10d transport)"
    report.row(case, "C10dTransport.call_sync", small["c10d"])
    report.row(case, "rpc.rpc_sync (TensorPipe, TCP only)", small["tensorpipe"], baseline=True)
    report.row(case, "dist.send/recv (same gloo group)", small["raw"])
    case = "4 MB tensor each way (c10d transport)"
    moved = 2 * 4 * (1 << 20)
    for impl, key, base in (
        ("C10dTransport.call_sync", "c10d", False),
        ("rpc.rpc_sync (TensorPipe, TCP only)", "tensorpipe", False),
        ("dist.send/recv (same gloo group)", "raw", True),
    ):
        report.row(case, impl, moved / big[key] / 1e9, unit="GB/s", baseline=base, higher_is_better=True)
    report.target("c10d small call vs TensorPipe TCP-only", small["c10d"] / small["tensorpipe"], "<=", 1.0)
    report.target("c10d 4 MB bandwidth vs raw send/recv", big["raw"] / big["c10d"], ">=", 0.8)
    report.note(
        f"c10d small call / raw send+recv round trip: {small['c10d'] / small['raw']:.2f}x; 4 MB: "
        f"c10d / TensorPipe time {big['c10d'] / big['tensorpipe']:.2f}x"
    )
    report.note(f"total run time {time.perf_counter() - started:.1f} s, quick={args.quick}")
    report.finish(args)


if __name__ == "__main__":
    main()
