"""CUDA paths (run by ``nox -s gpu``; skipped without a CUDA device)."""

from __future__ import annotations

from multiprocessing.pool import MaybeEncodingError

import pool_testutils as tu
import pytest
import torch

from pc_pool import Pool


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
