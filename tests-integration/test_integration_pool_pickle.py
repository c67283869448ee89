"""pc-pool with pc-pickle: lambdas and closures over tensors, shared or copied, across processes."""

from __future__ import annotations

import pickle

import pytest
import torch

import pc_pickle
import pc_pool


def test_shared_tensors_written_by_workers_are_seen_by_the_caller() -> None:
    data = torch.zeros(4, 8)
    with pc_pool.Pool(2, is_copy_tensor=False, share_method="cpu") as pool:
        # The lambda closes over `data`; shared, the workers' writes land in the caller's tensor.
        rows = pool.map(lambda i: data[i].fill_(i + 1).sum().item(), range(4), chunksize=1)
    assert rows == [8.0, 16.0, 24.0, 32.0]
    assert torch.equal(data, torch.arange(1, 5, dtype=torch.float32).unsqueeze(1).expand(4, 8))


def test_copied_tensors_keep_the_caller_unchanged() -> None:
    data = torch.zeros(4, 8)
    with pc_pool.Pool(2, is_copy_tensor=True) as pool:
        rows = pool.map(lambda i: data[i].fill_(i + 1).sum().item(), range(4), chunksize=1)
        results = pool.map(lambda t: t * 2, [torch.ones(3), torch.arange(3.0)])
    assert rows == [8.0, 16.0, 24.0, 32.0]
    assert torch.count_nonzero(data) == 0  # the workers wrote into copies
    assert torch.equal(results[1], torch.tensor([0.0, 2.0, 4.0]))


def test_results_returned_shared_are_usable_after_the_pool_is_gone() -> None:
    with pc_pool.Pool(1, is_copy_tensor=False, share_method="cpu") as pool:
        out = pool.apply(lambda n: torch.arange(n, dtype=torch.float64), (1000,))
    assert out.dtype == torch.float64
    assert float(out.sum()) == 999 * 1000 / 2


def test_unpicklable_argument_fails_that_task_only_with_the_path_named() -> None:
    with pc_pool.Pool(1, is_copy_tensor=True) as pool:
        gen = (i for i in range(3))
        with pytest.raises(pickle.PicklingError, match="gen"):
            pool.apply(lambda holder: holder, ({"gen": gen},))
        assert pool.apply(lambda a, b: a + b, (2, 3)) == 5


def test_pc_pickle_round_trips_what_the_pool_sends() -> None:
    scale = torch.tensor(3.0)
    fn = pc_pickle.loads(pc_pickle.dumps(lambda t: t * scale, copy_tensor=True))
    assert torch.equal(fn(torch.ones(2)), torch.full((2,), 3.0))
