"""CUDA tensors through the c10d RPC backend against a raw send/recv of the same bytes (issue 32), 2 ranks.

Both ranks share cuda:0 (one-GPU machines), so the pair talks over gloo, whose point-to-point ops only read
and write host memory: every way of moving a CUDA tensor between them copies it to the host and back. Cases:

- **registered_sync, c10d**: rank 0 calls a registered service of rank 1 with one CUDA tensor as its
  argument; the service returns the tensor's element count (a few bytes back). The codec copies the tensor
  into pinned host memory, the transport sends that, rank 1 copies it onto cuda:0 and runs the service.
- **raw send/recv (floor)**: the same bytes on a gloo pair link of its own (``_torch_dist.pair_link``, how the
  c10d backend makes its links): rank 0 copies the tensor into a pinned buffer made once and sends it;
  rank 1 receives into a pinned buffer made once, copies it onto cuda:0, synchronizes, and sends back an
  8-byte acknowledgement, which rank 0 waits for. The least any transport on this link can do.

Sizes: 256 MB (issue 32's target: c10d at least 0.5x the raw bandwidth) and 4 MB. Rank 0's wall time per
transfer; the two variants alternate round by round, and the target's value is the median over rounds of raw
time / c10d time of adjacent samples. Ranks on distinct GPUs over NCCL are not measured: the c10d backend's
links are gloo links (see docs/distributed.md). Without CUDA it writes a report holding only a note.

Run from the repository root:
``python packages/pc-distributed/benchmarks/run_rpc_backends_cuda.py [--quick] [--out PATH]``.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
import torch
from benchlib import Report, bench_args
from run_rpc_backends import WAIT, raw_link

import pc_distributed as pd

TARGET = 0.5  # issue 32: 256 MB CUDA through registered_sync / raw send+recv bandwidth
_DATA_TAG, _ACK_TAG = 11, 12
SIZES = {"256 MB": 256 << 20, "4 MB": 4 << 20}  # bytes
C10D = "registered_sync, c10d (pinned host copy each way)"
RAW = "gloo pair link send+recv, pinned buffers (floor)"


def element_count(tensor: torch.Tensor) -> int:
    """The service: touches the tensor where it arrived."""
    assert tensor.is_cuda
    return tensor.numel()


def _raw_send(link: Any, tensor: torch.Tensor, host: torch.Tensor, ack: torch.Tensor) -> None:
    host.copy_(tensor.view(-1).view(torch.uint8))
    link.send([host], 1, _DATA_TAG).wait()
    link.recv([ack], 1, _ACK_TAG).wait()


def _raw_receive(link: Any, tensor: torch.Tensor, host: torch.Tensor, ack: torch.Tensor) -> None:
    link.recv([host], 0, _DATA_TAG).wait()
    tensor.view(-1).view(torch.uint8).copy_(host)
    torch.cuda.synchronize()
    link.send([ack], 0, _ACK_TAG).wait()


def _measure(rank: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Rank 0's seconds per transfer, per size and variant, the variants alternating round by round."""
    torch.cuda.set_device(0)
    world = pd.get_world()
    assert world is not None
    group = world.create_rpc_group("bench", ["0", "1"], timeout=WAIT)
    if rank == 1:
        group.register("count", element_count)
    link = raw_link(rank, "bench/raw-cuda")
    ack = torch.zeros(8, dtype=torch.uint8)
    group.barrier(WAIT)
    out: dict[str, dict[str, list[float]]] = {}
    for case, nbytes in SIZES.items():
        tensor = torch.ones(nbytes // 4, device="cuda:0")
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        samples: dict[str, list[float]] = {"rpc": [], "raw": []}
        for r in range(rounds + 1):  # round 0 warms up (pinned allocations, links)
            for variant in ("rpc", "raw") if r % 2 == 0 else ("raw", "rpc"):
                if rank == 1:
                    if variant == "raw":
                        _raw_receive(link, tensor, host, ack)
                    continue
                torch.cuda.synchronize()
                start = time.perf_counter()
                if variant == "rpc":
                    assert group.registered_sync("count", args=(tensor,), timeout=WAIT) == tensor.numel()
                else:
                    _raw_send(link, tensor, host, ack)
                if r:
                    samples[variant].append(time.perf_counter() - start)
        out[case] = samples
        del tensor, host
    group.barrier(WAIT)
    return out


def main() -> None:
    args = bench_args("pc-distributed RPC backends (CUDA)")
    report = Report("pc-distributed")
    if not torch.cuda.is_available():
        report.note("CUDA RPC benchmark skipped: no CUDA device on this machine")
        report.finish(args)
        return
    rounds = 3 if args.quick else 8
    got = pd.run_world(
        _measure, 2, args=(rounds,), rpc_backend="c10d", backend="gloo", start_method="spawn", timeout=300
    )[0]
    for case, nbytes in SIZES.items():
        rpc, raw = got[case]["rpc"], got[case]["raw"]
        label = f"(cuda) issue 32: a {case} CUDA tensor to another rank, 2 ranks on cuda:0 (gloo)"
        report.row(label, C10D, nbytes / statistics.median(rpc) / 1e9, "GB/s", higher_is_better=True)
        report.row(
            label, RAW, nbytes / statistics.median(raw) / 1e9, "GB/s", baseline=True, higher_is_better=True
        )
        if case == "256 MB":
            ratio = statistics.median(r / c for c, r in zip(rpc, raw, strict=True))
            report.target(
                "(issue 32, cuda) 256 MB CUDA tensor through registered_sync / raw send+recv bandwidth",
                ratio,
                ">=",
                TARGET,
                note=""
                if ratio >= TARGET
                else f"medians: c10d {statistics.median(rpc):.3f} s, raw {statistics.median(raw):.3f} s",
            )
    report.note(
        f"c10d RPC with CUDA tensors: {torch.cuda.get_device_name(0)}, torch {torch.__version__}; rank 0's "
        f"wall time per transfer, {rounds} alternating rounds after a warm-up, medians; NCCL between ranks "
        "on distinct GPUs is not a c10d RPC link and was not measured"
    )
    report.finish(args)


if __name__ == "__main__":
    main()
