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
