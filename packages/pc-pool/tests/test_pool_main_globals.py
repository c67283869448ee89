"""A script's ``__main__`` lambdas and functions run in spawned workers with the globals they reference."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

_SCRIPT = textwrap.dedent(
    """
    import torch
    from pc_pool import Pool

    def helper(t):
        return t.sum().item()

    if __name__ == "__main__":
        # Defined under the guard: a spawned worker re-runs this file as __mp_main__ without this block.
        scale = 3.0
        offset = torch.tensor(0.5)

        def shifted(t):
            return helper(t * scale) + offset.item()

        tensors = [torch.full((2,), float(i)) for i in range(4)]
        with Pool(2) as pool:  # spawn: the default without share_method="cpu"
            it = pool.imap(lambda t: (t * scale).sum().item(), tensors)
            lambdas = [it.next(timeout=60) for _ in tensors]
            functions = pool.map_async(shifted, tensors).get(60)
        print(repr((lambdas, functions)))
    """
)


def test_pool_spawned_workers_see_main_globals_defined_under_the_guard(tmp_path: Path) -> None:
    script = tmp_path / "main_globals_script.py"
    script.write_text(_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=170, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lambdas, functions = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert lambdas == [0.0, 6.0, 12.0, 18.0]
    assert functions == [0.5, 6.5, 12.5, 18.5]
