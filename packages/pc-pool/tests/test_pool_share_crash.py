"""Share mode: a worker crash fails only the chunk it was running; results it had finished survive."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pool_testutils as tu
import pytest
import torch

import pc_pool


def _tensor_or_die(x: int) -> torch.Tensor:
    if x % 10 == 9:
        os.kill(os.getpid(), signal.SIGKILL)
    return torch.full((4,), float(x))


def test_pool_share_mode_crash_keeps_finished_results() -> None:
    # The crashing task runs right after its worker sent a shared result: with the 'file_descriptor' strategy
    # the parent fetches that result's fd from the worker when it loads it, so the worker must not get to the
    # crash before the parent has loaded the result (before: 1-6 finished results failed per crash).
    items = list(range(40))
    with pc_pool.Pool(2, share_method="cpu", is_copy_tensor=False) as pool:
        results = [pool.apply_async(_tensor_or_die, (x,)) for x in items]
        lost = []
        for x, result in zip(items, results, strict=True):
            if x % 10 == 9:
                with pytest.raises(pc_pool.WorkerDiedError):
                    result.get(tu.T)
                continue
            try:
                value = result.get(tu.T)
            except Exception as exc:  # SharedHandleError: the fd could not be fetched from the dead worker
                lost.append(f"{x}: {type(exc).__name__}: {exc}")
                continue
            assert torch.equal(value, torch.full((4,), float(x)))
        assert not lost, lost


def _tensor(x: int) -> torch.Tensor:
    return torch.full((4,), float(x))


def test_pool_share_mode_result_survives_a_kill_before_the_parent_loads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Issue 16 case 5, the last window: the worker has sent its finished result and is killed before the
    # parent loads it. The parent's load is held until the worker is dead (waitid without reaping), an event,
    # not a sleep. Before: under 'file_descriptor' the fd was fetched from the dead worker at load time
    # (SharedHandleError); now the fds travel with the result (SCM_RIGHTS) and the result survives.
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
    with pc_pool.Pool(1, share_method="cpu", is_copy_tensor=False) as pool:
        real_loads = pc_pool._serial.loads
        killed: list[int] = []

        # A replacement worker forked while this is installed loads arguments through it: pass keywords on.
        def loads_after_the_worker_died(data: bytes, **kwargs: Any) -> object:
            if not killed:
                pid = pool._workers[0].process.pid
                os.kill(pid, signal.SIGKILL)
                os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # dead, left for the pool to reap
                killed.append(pid)
            return real_loads(data, **kwargs)

        monkeypatch.setattr(pc_pool._serial, "loads", loads_after_the_worker_died)
        value = pool.apply_async(_tensor, (5,)).get(tu.T)
        assert killed
        assert torch.equal(value, torch.full((4,), 5.0))
        monkeypatch.undo()
        assert pool.apply_async(_tensor, (6,)).get(tu.T)[0].item() == 6.0  # a replacement serves


_FILE_SYSTEM_SCRIPT = textwrap.dedent(
    """
    import logging, os, signal, sys
    import torch
    import pc_pool

    def tensor_or_die(x):
        if x % 10 == 9:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.full((4,), float(x))

    if __name__ == "__main__":
        torch.multiprocessing.set_sharing_strategy("file_system")
        logging.getLogger("pc_pool").setLevel(logging.ERROR)
        died, lost = [], []
        with pc_pool.Pool(2, share_method="cpu", is_copy_tensor=False) as pool:
            results = [pool.apply_async(tensor_or_die, (x,)) for x in range(40)]
            for x, result in enumerate(results):
                try:
                    assert torch.equal(result.get(60), torch.full((4,), float(x)))
                except pc_pool.WorkerDiedError:
                    died.append(x)
                except Exception as exc:
                    lost.append(f"{x}: {exc!r}")
            # The last window: the worker sent its result and is killed before the parent loads it.
            real_loads = pc_pool._serial.loads
            killed = []

            def loads_after_the_worker_died(data, **kwargs):
                if not killed:
                    pid = pool._workers[0].process.pid
                    os.kill(pid, signal.SIGKILL)
                    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
                    killed.append(pid)
                return real_loads(data, **kwargs)

            pool.map(abs, [1, 2])  # both workers idle: the next apply goes to worker 0
            pc_pool._serial.loads = loads_after_the_worker_died
            late = pool.apply_async(tensor_or_die, (5,)).get(60)
            pc_pool._serial.loads = real_loads
        print(repr((died, lost, bool(killed), late.tolist())))
    """
)


def test_pool_share_mode_file_system_results_survive_without_an_acknowledgement(tmp_path: Path) -> None:
    # Issue 20 dropped the per-result acknowledgement (a worker waited after each shared result until the
    # parent had loaded it). Under the 'file_system' strategy too, a finished result survives its worker's
    # crash in the next task and a kill between sending it and the parent's load.
    script = tmp_path / "share_fs_script.py"
    script.write_text(_FILE_SYSTEM_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=170, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    died, lost, killed, late = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert died == [9, 19, 29, 39]
    assert lost == []
    assert killed
    assert late == [5.0, 5.0, 5.0, 5.0]
