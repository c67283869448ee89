"""pc-pickle CUDA benchmark: copying a CUDA tensor through dumps+loads, and a CUDA share handle.

Run from the repository root: ``python packages/pc-pickle/benchmarks/run_cuda.py [--quick] [--out PATH]``.
Peers, interleaved in one process: pickle protocol 5, ``torch.save``/``torch.load`` through memory, and
torch's ``ForkingPickler`` (CUDA IPC handle). Without a CUDA device it writes a report holding only a note.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import sys
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
import torch
from benchlib import Report, bench_args, interleaved_min

import pc_pickle


def _torch_save_round_trip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def main() -> None:
    args = bench_args("pc-pickle")
    report = Report("pc-pickle")
    if not torch.cuda.is_available():
        report.note("CUDA benchmarks skipped: no CUDA device on this machine")
        report.finish(args)
        return
    repeat = 3 if args.quick else 7
    device = torch.cuda.get_device_name(0)
    report.note(f"CUDA: {device}, torch {torch.__version__}; min of interleaved rounds")

    mb = 16 if args.quick else 256
    big = {"weight": torch.randn(mb * 1_000_000 // 4, device="cuda"), "step": 3}
    case = f"(cuda) {mb} MB CUDA tensor dumps+loads"
    t = interleaved_min(
        {
            "pc_pickle": lambda: pc_pickle.loads(pc_pickle.dumps(big)),
            "pickle5": lambda: pickle.loads(pickle.dumps(big, protocol=5)),
            "torch.save/load": lambda: _torch_save_round_trip(big),
        },
        repeat,
        sync=torch.cuda.synchronize,
    )
    out = pc_pickle.loads(pc_pickle.dumps(big))
    if out["weight"].device != big["weight"].device or not torch.equal(out["weight"], big["weight"]):
        raise AssertionError("pc_pickle's CUDA copy round trip changed the tensor or its device")
    for name, value in t.items():
        report.row(case, name, value, baseline=(name == "pickle5"))
    report.target("(cuda) CUDA tensor dumps+loads vs pickle5", t["pc_pickle"] / t["pickle5"], "<=", 1.0)
    gbps = 2 * mb / 1000 / t["pc_pickle"]
    report.row(f"{case}: GB/s device<->host", "pc_pickle", gbps, unit="GB/s", higher_is_better=True)

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
