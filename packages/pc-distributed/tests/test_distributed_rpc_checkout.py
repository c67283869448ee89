"""A script's lambdas that use pc_distributed travel over RPC when it is imported from a source checkout.

The script runs as its own ``__main__`` in a fresh interpreter, with this package's ``src`` directory first on
``PYTHONPATH`` (how a checkout or an editable install is imported: from a directory outside ``site-packages``
and ``sys.prefix``). A lambda of ``__main__`` travels by value and carries the globals it uses; the module
``pc_distributed`` among them must travel by name, not with its state (which holds the process's World).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.backends_inside

_SRC = Path(__file__).resolve().parents[1] / "src"

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    import pc_distributed as pd

    NAME_OF = lambda: pd.get_cur_name()  # a lambda of __main__'s top level


    def calls(rank):
        group = pd.get_world().create_rpc_group("checkout", ["0", "1"])
        out = None
        if rank == 1:
            out = []
            for send in (
                lambda: group.rpc_sync("0", NAME_OF),
                lambda: group.rpc_sync("0", lambda: pd.get_cur_name()),
                lambda: group.rpc_async("0", lambda: pd.get_cur_name() + "!").wait(),
                lambda: group.remote("0", lambda: [pd.get_cur_name()]).to_here(),
            ):
                try:
                    out.append(send())
                except Exception as exc:
                    out.append(f"{type(exc).__name__}: {exc}")
        group.barrier(timeout=60)
        group.destroy()
        return out


    if __name__ == "__main__":
        method = "spawn" if torch.cuda.is_available() else "fork"
        results = pd.run_world(
            calls, 2, rpc_backend=sys.argv[1], start_method=method, timeout=150, rpc_timeout=60
        )
        print("RESULT " + json.dumps({"file": pd.__file__, "results": results}))
    """
)


@pytest.mark.parametrize("backend", ["tensorpipe", "c10d"])
def test_a_main_lambda_using_a_checkout_pc_distributed_runs_on_the_peer(tmp_path: Path, backend: str) -> None:
    script = tmp_path / "checkout_user.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_SRC), *sys.path])}
    done = subprocess.run(
        [sys.executable, str(script), backend],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result; rc={done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    report = json.loads(lines[-1][len("RESULT ") :])
    assert Path(report["file"]).parent.parent == _SRC  # imported from the checkout, not site-packages
    assert report["results"] == [None, ["0", "0", "0!", ["0"]]]
