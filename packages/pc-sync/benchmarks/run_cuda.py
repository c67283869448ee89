"""pc-sync CUDA benchmark: synchronized batch norm on one GPU against ``nn.BatchNorm2d``.

Run from the repository root: ``python packages/pc-sync/benchmarks/run_cuda.py [--quick] [--out PATH]``.
Measures one training step (forward + backward) and one eval forward of ``SynchronizedBatchNorm2d`` alone and
inside ``ReplicationCallbackDataParallel`` with one replica (``device_ids=[0]``) and with two replicas on one
GPU (``[0, 0]``: the replicas synchronise their statistics), against ``nn.BatchNorm2d`` alone and inside
``nn.DataParallel`` with the same device ids, interleaved in one process; then a small network, three
(conv 3x3, batch norm, ReLU) blocks, in two replicas on one GPU against ``nn.DataParallel`` with
``nn.BatchNorm2d``. Cross-GPU replicas need two devices: not measured on a one-GPU machine. Without a CUDA
device it writes a report holding only a note.
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
import torch
from benchlib import Report, bench_args, interleaved_min
from torch import nn

from pc_replicate import ReplicationCallbackDataParallel
from pc_sync import SynchronizedBatchNorm2d


def _train_step(module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> Callable[[], None]:
    module.train()

    def step() -> None:
        x.grad = None
        module(x).backward(g)

    return step


def _net(norm: Callable[[int], nn.Module], channels: int = 64) -> nn.Sequential:
    """Three (conv 3x3, batch norm, ReLU) blocks: where the step's time is not all batch norm."""
    blocks: list[nn.Module] = []
    for _ in range(3):
        blocks += [nn.Conv2d(channels, channels, 3, padding=1, bias=False), norm(channels), nn.ReLU()]
    return nn.Sequential(*blocks)


def _net_rows(report: Report, repeat: int, number: int) -> None:
    shape = (32, 64, 28, 28)
    label = "x".join(map(str, shape))
    x = torch.randn(shape, device="cuda", requires_grad=True)
    g = torch.randn(shape, device="cuda")
    torch.manual_seed(0)
    ours = ReplicationCallbackDataParallel(_net(SynchronizedBatchNorm2d).cuda(), device_ids=[0, 0])
    plain = nn.DataParallel(_net(nn.BatchNorm2d).cuda(), device_ids=[0, 0])
    t = interleaved_min(
        {
            "3x(conv, SyncBN2d, ReLU) in ReplicationCallbackDataParallel[0, 0]": _train_step(ours, x, g),
            "3x(conv, BatchNorm2d, ReLU) in nn.DataParallel[0, 0]": _train_step(plain, x, g),
        },
        repeat,
        number,
        sync=torch.cuda.synchronize,
    )
    for name, value in t.items():
        case = f"(cuda) train step, 3-block net, {label}"
        report.row(case, name, value, baseline="nn.DataParallel" in name)
    ours_t, plain_t = t.values()
    report.target(
        f"(cuda) 3x(conv, BN, ReLU), two replicas on one GPU vs nn.DataParallel[0, 0], {label}",
        ours_t / plain_t,
        "<=",
        1.1,
    )


def main() -> None:
    args = bench_args("pc-sync")
    report = Report("pc-sync")
    if not torch.cuda.is_available():
        report.note("CUDA benchmarks skipped: no CUDA device on this machine")
        report.finish(args)
        return
    repeat, number = (3, 10) if args.quick else (9, 100)  # a step is ~0.2 ms: launch-bound, noisy
    report.note(
        f"CUDA: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}; "
        f"min over {repeat} interleaved rounds of the mean of {number} calls"
    )
    for shape in [(32, 64, 28, 28), (64, 256, 14, 14)]:
        label = "x".join(map(str, shape))
        x = torch.randn(shape, device="cuda", requires_grad=True)
        g = torch.randn(shape, device="cuda")
        ours = SynchronizedBatchNorm2d(shape[1]).cuda()
        plain = nn.BatchNorm2d(shape[1]).cuda()
        ours_dp = ReplicationCallbackDataParallel(SynchronizedBatchNorm2d(shape[1]).cuda(), device_ids=[0])
        plain_dp = nn.DataParallel(nn.BatchNorm2d(shape[1]).cuda(), device_ids=[0])
        ours_dp2 = ReplicationCallbackDataParallel(
            SynchronizedBatchNorm2d(shape[1]).cuda(), device_ids=[0, 0]
        )
        plain_dp2 = nn.DataParallel(nn.BatchNorm2d(shape[1]).cuda(), device_ids=[0, 0])
        t = interleaved_min(
            {
                "SyncBN2d": _train_step(ours, x, g),
                "BatchNorm2d": _train_step(plain, x, g),
                "SyncBN2d in ReplicationCallbackDataParallel[0]": _train_step(ours_dp, x, g),
                "BatchNorm2d in nn.DataParallel[0]": _train_step(plain_dp, x, g),
                "SyncBN2d in ReplicationCallbackDataParallel[0, 0]": _train_step(ours_dp2, x, g),
                "BatchNorm2d in nn.DataParallel[0, 0]": _train_step(plain_dp2, x, g),
            },
            repeat,
            number,
            sync=torch.cuda.synchronize,
        )
        case = f"(cuda) train step {label}"
        for name, value in t.items():
            report.row(case, name, value, baseline=(name == "BatchNorm2d"))
        ratio = t["SyncBN2d"] / t["BatchNorm2d"]
        report.target(f"(cuda) non-parallel train step vs BN, {label}", ratio, "<=", 1.05)
        report.target(
            f"(cuda) one-GPU DataParallel step vs nn.DataParallel, {label}",
            t["SyncBN2d in ReplicationCallbackDataParallel[0]"] / t["BatchNorm2d in nn.DataParallel[0]"],
            "<=",
            1.1,
        )
        report.target(
            f"(cuda) two replicas on one GPU vs nn.DataParallel[0, 0], {label}",
            t["SyncBN2d in ReplicationCallbackDataParallel[0, 0]"]
            / t["BatchNorm2d in nn.DataParallel[0, 0]"],
            "<=",
            1.1,
        )
        xd = x.detach()
        evals: dict[str, Callable[[], None]] = {}
        for name, module in (("SyncBN2d", ours), ("BatchNorm2d", plain)):
            module.eval()
            evals[name] = lambda m=module, inp=xd: m(inp)
        with torch.no_grad():
            t = interleaved_min(evals, repeat, number, sync=torch.cuda.synchronize)
        for name, value in t.items():
            report.row(f"(cuda) eval {label}", name, value, baseline=(name == "BatchNorm2d"))
    _net_rows(report, repeat, number // 2)
    if torch.cuda.device_count() < 2:
        report.note(
            "not measured with one GPU: cross-GPU replicas (torch.nn.SyncBatchNorm under DDP: "
            "run_processes_cuda.py, gloo ranks sharing cuda:0)"
        )
    report.finish(args)


if __name__ == "__main__":
    main()
