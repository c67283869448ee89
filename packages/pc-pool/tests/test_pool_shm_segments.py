"""/dev/shm stays flat across share-mode pools with the 'file_system' strategy (set in a child script)."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

_SCRIPT = textwrap.dedent(
    """
    import os
    import psutil, torch
    import pc_pool

    def double(t):
        return t * 2

    def ours(pids):
        return sorted(n for n in os.listdir("/dev/shm") if any(n.startswith(f"torch_{p}_") for p in pids))

    if __name__ == "__main__":
        torch.multiprocessing.set_sharing_strategy("file_system")
        pids, counts = {os.getpid()}, []
        for _ in range(3):
            with pc_pool.Pool(2, is_copy_tensor=False, share_method="cpu") as pool:
                pids.update(p.pid for p in psutil.Process().children(recursive=True))
                result = pool.map_async(double, [torch.full((8,), float(i)) for i in range(40)], chunksize=1)
                values = result.get(60)
                assert [v[0].item() for v in values] == [2.0 * i for i in range(40)]
                del values, result
            counts.append(len(ours(pids)))
        print(repr(counts))
    """
)


def test_pool_file_system_share_leaves_no_segments_across_pools(tmp_path: Path) -> None:
    # Issue 16: 186 segments per closed pool, growing across pools. The workers' result tensors were kept
    # alive by a reference cycle in dumps until the workers were stopped, so their refcounts never dropped.
    script = tmp_path / "shm_segments_script.py"
    script.write_text(_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=170, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert ast.literal_eval(done.stdout.strip().splitlines()[-1]) == [0, 0, 0]
