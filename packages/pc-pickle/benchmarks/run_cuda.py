"""pc-pickle CUDA benchmark: copying a CUDA tensor through dumps+loads, and a CUDA share handle.

Run from the repository root: ``python packages/pc-pickle/benchmarks/run_cuda.py [--quick] [--out PATH]``.
Beside pc_pickle's copy round trip, in one process and interleaved: the pinned-copy limit (a device->host
copy into pinned memory and back, the same bytes: what the bus allows), the pageable copies (``.cpu()`` and
``.to("cuda")``), pickle protocol 5 and ``torch.save``/``torch.load`` through memory; torch's
``ForkingPickler`` for the share handle. The peak host memory of one dumps and of one loads is measured from
the process's resident set (its peak reset through ``/proc/self/clear_refs``, or sampled where that is
refused). Without a CUDA device it writes a report holding only a note.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
import torch
from benchlib import Report, bench_args, interleaved_min

import pc_pickle
from pc_pickle import _device_copy

_PAGE = 4096


def _torch_save_round_trip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * _PAGE


def _hwm() -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        return False
    hwm = _hwm()
    return hwm is not None and hwm <= _rss() + (1 << 20)


def peak_extra_bytes(fn: Callable[[], Any]) -> tuple[int, Any, str]:
    """The most resident memory ``fn`` added above what the process held before, and fn's result."""
    before = _rss()
    if _reset_hwm():
        result = fn()
        hwm = _hwm()
        return max(0, (hwm or before) - before), result, "VmHWM after /proc/self/clear_refs"
    peak = before
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.0005):
            peak = max(peak, _rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = fn()
    finally:
        done.set()
        sampler.join(10)
    return max(0, max(peak, _rss()) - before), result, "RSS sampled every 0.5 ms"


def _copy_round_trip(device_bytes: torch.Tensor) -> tuple[Callable[[], None], Callable[[], None]]:
    pinned = torch.empty(device_bytes.shape, dtype=torch.uint8, pin_memory=True)
    back = torch.empty_like(device_bytes)

    def pinned_limit() -> None:
        pinned.copy_(device_bytes, non_blocking=True)
        back.copy_(pinned, non_blocking=True)

    def pageable() -> None:
        back.copy_(device_bytes.cpu())

    return pinned_limit, pageable


def _dumps_vs_floor(big: dict[str, Any], floor: str, repeat: int) -> dict[str, float]:
    """``dumps`` alone against its floor: the device->host copy into pinned memory, then one host copy."""
    source = big["weight"].view(torch.uint8)
    pinned = torch.empty(source.shape, dtype=torch.uint8, pin_memory=True)
    host = torch.ones(source.shape, dtype=torch.uint8)  # touched: the floor has no page faults

    def pinned_d2h_and_host_copy() -> None:
        pinned.copy_(source, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        host.copy_(pinned)

    return interleaved_min(
        {"pc_pickle.dumps": lambda: pc_pickle.dumps(big), floor: pinned_d2h_and_host_copy},
        repeat,
        sync=torch.cuda.synchronize,
    )


def main() -> None:
    args = bench_args("pc-pickle")
    report = Report("pc-pickle")
    if not torch.cuda.is_available():
        report.note("CUDA benchmarks skipped: no CUDA device on this machine")
        report.finish(args)
        return
    repeat = 3 if args.quick else 5
    device = torch.cuda.get_device_name(0)
    report.note(f"CUDA: {device}, torch {torch.__version__}; min of {repeat} interleaved rounds")

    mb = 16 if args.quick else 256
    nbytes = mb * 1_000_000
    weight = torch.randn(nbytes // 4, device="cuda")
    big = {"weight": weight, "step": 3}
    pinned_limit, pageable = _copy_round_trip(weight.view(torch.uint8))
    case = f"(cuda) {mb} MB CUDA tensor dumps+loads"
    t = interleaved_min(
        {
            "pc_pickle": lambda: pc_pickle.loads(pc_pickle.dumps(big)),
            "pinned copy D2H+H2D (the limit)": pinned_limit,
            "pageable copy .cpu() + .to(cuda)": pageable,
            "pickle5": lambda: pickle.loads(pickle.dumps(big, protocol=5)),
            "torch.save/load": lambda: _torch_save_round_trip(big),
        },
        repeat,
        sync=torch.cuda.synchronize,
    )
    out = pc_pickle.loads(pc_pickle.dumps(big))
    if out["weight"].device != weight.device or not torch.equal(out["weight"], weight):
        raise AssertionError("pc_pickle's CUDA copy round trip changed the tensor or its device")
    del out
    limit = "pinned copy D2H+H2D (the limit)"
    for name, value in t.items():
        report.row(case, name, value, baseline=(name == limit))
    report.target(
        f"(cuda) {mb} MB CUDA tensor dumps+loads vs the pinned-copy limit",
        t["pc_pickle"] / t[limit],
        "<=",
        2.0,
    )
    report.target("(cuda) CUDA tensor dumps+loads vs pickle5", t["pc_pickle"] / t["pickle5"], "<=", 1.0)
    floor = "pinned copy D2H + one host copy"
    d = _dumps_vs_floor(big, floor, repeat)
    for name, value in d.items():
        report.row(f"(cuda) {mb} MB CUDA tensor dumps", name, value, baseline=(name == floor))
    report.target(
        f"(cuda) {mb} MB CUDA tensor dumps vs a pinned D2H copy plus one host copy",
        d["pc_pickle.dumps"] / d[floor],
        "<=",
        1.5,
    )
    gbps = 2 * nbytes / 1e9 / t["pc_pickle"]
    report.row(f"{case}: GB/s device<->host", "pc_pickle", gbps, unit="GB/s", higher_is_better=True)
    report.row(f"{case}: GB/s device<->host", "pinned copy", 2 * nbytes / 1e9 / t[limit], unit="GB/s")

    # Peak host memory: one dumps (the payload is part of it), then one loads of that payload.
    torch.cuda.synchronize()
    extra, payload, how = peak_extra_bytes(lambda: pc_pickle.dumps(big))
    payload_bytes: bytes = payload
    pool = _device_copy.staging_pool().bound_bytes
    report.row(f"(cuda) {mb} MB dumps: peak host memory", "pc_pickle", extra / 1e6, unit="MB")
    report.target(
        f"(cuda) {mb} MB dumps peak host memory (bound: 1.1x the tensor + the {pool >> 20} MiB pool)",
        extra / 1e6,
        "<=",
        (1.1 * nbytes + pool) / 1e6,
        unit=" MB",
    )
    load_extra, _, _ = peak_extra_bytes(lambda: pc_pickle.loads(payload_bytes))
    report.row(
        f"(cuda) {mb} MB loads: peak host memory beyond the payload", "pc_pickle", load_extra / 1e6, "MB"
    )
    payload = payload_bytes = b""  # drop the 256 MB before the next measurement
    extra, _, _ = peak_extra_bytes(lambda: pickle.dumps(big, protocol=5))
    report.row(f"(cuda) {mb} MB dumps: peak host memory", "pickle5", extra / 1e6, unit="MB")
    report.note(f"peak host memory: {how}; the staging pool is allocated before it is measured")

    # share handle of a CUDA tensor: dumps time and payload size against torch's own reducer
    shared = torch.zeros(mb * 1_000_000 // 4, device="cuda")
    ours, theirs = [], []
    size = fp_size = 0
    for _ in range(max(repeat, 5)):
        start = time.perf_counter()
        data = pc_pickle.dumps(shared, copy_tensor=False)
        ours.append(time.perf_counter() - start)
        size = len(data)
        start = time.perf_counter()
        fp = bytes(ForkingPickler.dumps(shared))
        theirs.append(time.perf_counter() - start)
        fp_size = len(fp)
    report.row("(cuda) share handle dumps", "pc_pickle", min(ours))
    report.row("(cuda) share handle dumps", "torch ForkingPickler", min(theirs), baseline=True)
    report.row("(cuda) share handle payload", "pc_pickle", size, unit="B")
    report.row("(cuda) share handle payload", "torch ForkingPickler", fp_size, unit="B", baseline=True)
    report.target("(cuda) share handle dumps time", min(ours) * 1e3, "<=", 1.0, unit="ms")
    report.finish(args)


if __name__ == "__main__":
    main()
