"""Share mode: a worker crash fails only the chunk it was running; results it had finished survive."""

from __future__ import annotations

import os
import signal

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

        def loads_after_the_worker_died(data: bytes) -> object:
            if not killed:
                pid = pool._workers[0].process.pid
                os.kill(pid, signal.SIGKILL)
                os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # dead, left for the pool to reap
                killed.append(pid)
            return real_loads(data)

        monkeypatch.setattr(pc_pool._serial, "loads", loads_after_the_worker_died)
        value = pool.apply_async(_tensor, (5,)).get(tu.T)
        assert killed
        assert torch.equal(value, torch.full((4,), 5.0))
        monkeypatch.undo()
        assert pool.apply_async(_tensor, (6,)).get(tu.T)[0].item() == 6.0  # a replacement serves
