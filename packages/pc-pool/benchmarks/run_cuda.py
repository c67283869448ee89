"""pc-pool CUDA benchmark: a CUDA tensor shared with a worker and back, against torch.multiprocessing queues.

Run from the repository root: ``python packages/pc-pool/benchmarks/run_cuda.py [--quick] [--out PATH]``.
One spawned worker each: ``pc_pool.Pool(1, is_copy_tensor=False, share_method="cuda")`` applying an in-place
add to a CUDA tensor, against a ``torch.multiprocessing`` worker that gets the tensor from one queue, adds and
answers on another (the hand-written way to share CUDA tensors). Interleaved in one process; each call waits
for its answer. Without a CUDA device it writes a report holding only a note.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
import torch
import torch.multiprocessing as tmp
from benchlib import Report, bench_args, interleaved_min

import pc_pool

TIMEOUT_S = 60.0


def add_one(t: torch.Tensor) -> None:
    """The task: an in-place add on the shared tensor, finished before the answer is sent."""
    t.add_(1)
    torch.cuda.synchronize()


def queue_worker(inbox: Any, outbox: Any) -> None:
    """The torch.multiprocessing peer: apply ``add_one`` to every tensor received until ``None``."""
    while (t := inbox.get(timeout=TIMEOUT_S)) is not None:
        add_one(t)
        del t
        outbox.put(True)


def main() -> None:
    args = bench_args("pc-pool")
    report = Report("pc-pool")
    if not torch.cuda.is_available():
        report.note("CUDA benchmarks skipped: no CUDA device on this machine")
        report.finish(args)
        return
    repeat, number = (3, 5) if args.quick else (5, 20)
    report.note(
        f"CUDA: {torch.cuda.get_device_name(0)}, torch {torch.__version__}; one spawned worker each; "
        f"min over {repeat} interleaved rounds of the mean of {number} calls"
    )
    t = torch.zeros(1_000_000, device="cuda")  # 4 MB
    ctx = tmp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    peer = ctx.Process(target=queue_worker, args=(inbox, outbox), daemon=True)
    peer.start()

    def through_queues() -> None:
        inbox.put(t)
        outbox.get(timeout=TIMEOUT_S)

    try:
        with pc_pool.Pool(1, is_copy_tensor=False, share_method="cuda") as pool:
            times = interleaved_min(
                {
                    "pc_pool share": lambda: pool.apply_async(add_one, (t,)).get(TIMEOUT_S),
                    "torch.multiprocessing queues": through_queues,
                },
                repeat,
                number,
                sync=torch.cuda.synchronize,
            )
    finally:
        inbox.put(None)
        peer.join(TIMEOUT_S)
        if peer.is_alive():
            peer.kill()
    case = "(cuda) 4 MB CUDA tensor to a worker, in-place add, answer"
    for name, value in times.items():
        report.row(case, name, value, baseline=(name == "torch.multiprocessing queues"))
    report.finish(args)


if __name__ == "__main__":
    main()
