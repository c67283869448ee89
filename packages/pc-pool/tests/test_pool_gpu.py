"""CUDA paths (run by ``nox -s gpu``; skipped without a CUDA device)."""

from __future__ import annotations

from multiprocessing import resource_tracker
from multiprocessing.pool import MaybeEncodingError
from multiprocessing.reduction import ForkingPickler

import pool_testutils as tu
import pytest
import torch

from pc_pool import Pool, _serial


@pytest.fixture(scope="module", autouse=True)
def _process_wide_cuda_state() -> None:
    """Make this process's CUDA context, CUDA IPC state and spawn's resource tracker before the leak snapshot.

    Each is made once per process, by whichever test uses it first, and lives until the process exits (the
    driver's ``/dev/shm/cuda.shm.*`` descriptor among them): not a pool's leak, and without this the first
    CUDA test of a run would be blamed for them.
    """
    if torch.cuda.is_available():
        # torch.multiprocessing (imported by pc_pool) registered torch's reducers with ForkingPickler
        ForkingPickler.dumps(torch.zeros(1, device="cuda"))  # opens the driver's IPC state
        resource_tracker.ensure_running()


def _add_one_cuda(t: torch.Tensor) -> torch.Tensor:
    return t.add_(1)


def _add_one_cuda_in_place(t: torch.Tensor) -> None:
    t.add_(1)


def _make_cuda() -> torch.Tensor:
    return torch.full((4,), 3.0, device="cuda")


@pytest.mark.gpu
def test_pool_cuda_share_writes_show_and_results_arrive() -> None:
    with Pool(1, is_copy_tensor=False, share_method="cuda") as pool:
        t = torch.zeros(4, device="cuda")
        assert pool.apply_async(_add_one_cuda_in_place, (t,)).get(tu.T) is None
        torch.cuda.synchronize()
        assert torch.equal(t.cpu(), torch.ones(4))
        # torch cannot re-send a CUDA tensor from the process it was shared into: a clear error, pool intact
        with pytest.raises(MaybeEncodingError, match="clone"):
            pool.apply_async(_add_one_cuda, (t,)).get(tu.T)
        torch.cuda.synchronize()
        assert torch.equal(t.cpu(), torch.full((4,), 2.0))
        out = pool.apply_async(_make_cuda).get(tu.T)
        kept = out.clone()  # a shared CUDA result lives only as long as its worker
        del out
        assert kept.device.type == "cuda"
        assert torch.equal(kept.cpu(), torch.full((4,), 3.0))


@pytest.mark.gpu
def test_pool_cuda_copy_keeps_caller_tensor() -> None:
    with Pool(1, share_method="cuda") as pool:
        t = torch.zeros(4, device="cuda")
        out = pool.apply_async(_add_one_cuda, (t,)).get(tu.T)
        assert torch.equal(t.cpu(), torch.zeros(4))
        assert out.device.type == "cuda"
        assert torch.equal(out.cpu(), torch.ones(4))


@pytest.mark.parametrize("initialized", [False, True])
def test_collect_cuda_ipc_only_where_cuda_is_initialized(
    monkeypatch: pytest.MonkeyPatch, initialized: bool
) -> None:
    # Both branches on any machine: the collect runs after a pool's workers exit, and must not initialise
    # CUDA in a process that never used it.
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: calls.append("collect"))
    _serial.collect_cuda_ipc()
    assert calls == (["collect"] if initialized else [])
    calls.clear()
    with Pool(1, share_method="cpu") as pool:  # forked: no helper process outlives the test
        assert pool.apply(abs, (-3,)) == 3
        pool.close()
        pool.join(tu.T)
        assert ("collect" in calls) is initialized  # after the workers exited
    assert set(calls) == ({"collect"} if initialized else set())
