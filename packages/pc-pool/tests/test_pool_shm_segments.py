"""/dev/shm stays flat across share-mode pools with the 'file_system' strategy (set in a child script)."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SCRIPT = textwrap.dedent(
    """
    import os, select, signal, sys, time
    import psutil, torch
    import pc_pool

    def double(t):
        return t * 2

    STARTED_R, STARTED_W = os.pipe()  # inherited by the fork workers: "I hold my arguments and hang"

    def double_or_hang(t):
        if t[0].item() >= 2:
            os.write(STARTED_W, b"x")
            time.sleep(3600)  # running when terminate() comes: never returns
        return t * 2

    def hang_through_one_sigterm(t):
        if t[0].item() >= 2:
            # The first SIGTERM runs this handler instead of the pool's, as when it lands just before a
            # blocking call (the handler runs only after the call); only a later SIGTERM unwinds the worker.
            pool_handler = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, lambda signum, frame: signal.signal(signal.SIGTERM, pool_handler))
            os.write(STARTED_W, b"x")
            time.sleep(3600)
        return t * 2

    def ours(pids):
        return sorted(n for n in os.listdir("/dev/shm") if any(n.startswith(f"torch_{p}_") for p in pids))

    if __name__ == "__main__":
        torch.multiprocessing.set_sharing_strategy("file_system")
        pids, counts = {os.getpid()}, []
        for _ in range(3):
            retire = 1 if sys.argv[1] == "retiring" else None
            with pc_pool.Pool(2, maxtasksperchild=retire, is_copy_tensor=False, share_method="cpu") as pool:
                pids.update(p.pid for p in psutil.Process().children(recursive=True))
                if sys.argv[1] in ("drained", "retiring"):
                    args = [torch.full((8,), float(i)) for i in range(40)]
                    result = pool.map_async(double, args, chunksize=1)
                    values = result.get(60)
                    assert [v[0].item() for v in values] == [2.0 * i for i in range(40)]
                    del values, result, args
                else:  # abandoned: 2 results taken, then terminate() with chunks running and queued
                    task = double_or_hang if sys.argv[1] == "abandoned" else hang_through_one_sigterm
                    it = pool.imap(task, [torch.full((8,), float(i)) for i in range(20)])
                    assert [next(it)[0].item(), next(it)[0].item()] == [0.0, 2.0]
                    for _ in range(2):  # both workers run a hanging task (more chunks wait in the pipes)
                        assert select.select([STARTED_R], [], [], 60)[0], "no worker started a task"
                        os.read(STARTED_R, 1)
                    del it
            counts.append(len(ours(pids)))
        print(repr(counts))
    """
)


@pytest.mark.parametrize("mode", ["drained", "retiring", "abandoned", "first_sigterm_missed"])
def test_pool_file_system_share_leaves_no_segments_across_pools(tmp_path: Path, mode: str) -> None:
    # Issue 16: 186 segments per closed pool, growing across pools. The workers' result tensors were kept
    # alive by a reference cycle in dumps until the workers were stopped, so their refcounts never dropped.
    # "abandoned": terminate() with share payloads nobody loaded (chunks still in the task pipes) and workers
    # killed while holding arguments: 7, 10, 13 segments after 1, 2, 3 pools before the pool released the
    # unread payloads and workers unwound on SIGTERM. "retiring": maxtasksperchild=1, so each worker drains
    # (without loading) the chunks already sent to it when it retires; it now releases them.
    # "first_sigterm_missed": as "abandoned", but the workers' first SIGTERM does not unwind them (as when it
    # lands just before a blocking call): 2, 4, 6 segments (SIGKILL) before terminate() repeated SIGTERM.
    script = tmp_path / "shm_segments_script.py"
    script.write_text(_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), mode], capture_output=True, text=True, timeout=170, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert ast.literal_eval(done.stdout.strip().splitlines()[-1]) == [0, 0, 0]
