"""A fork pool's workers must not inherit garbage that only the parent can collect.

A torch gloo process group waits, in its destructor, for worker threads of its own. If such a group sits in an
uncollected reference cycle when the pool forks a worker, the worker's garbage collector would collect its
copy of the group, whose threads do not exist in the worker: the destructor would wait forever and the task
that ran the collection would never return. The pool collects the parent's garbage before it forks.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

import pc_pool


def test_a_fork_worker_does_not_inherit_a_gloo_group_it_cannot_collect() -> None:
    gc.disable()  # the cycle below stays uncollected until the pool collects it
    pool = None
    try:
        group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
        group.allreduce([torch.ones(1)]).wait()  # its worker threads are up, waiting for work
        cycle: list[Any] = [group]
        cycle.append(cycle)
        del cycle, group
        with warnings.catch_warnings():
            # Python >= 3.12 warns when a multi-threaded process forks; fork is what share_method="cpu" asks.
            warnings.filterwarnings("ignore", message=".*multi-threaded.*fork.*", category=DeprecationWarning)
            pool = pc_pool.Pool(1, share_method="cpu")
        # Without the parent's collection the worker's gc.collect() hangs in the group's destructor.
        collected = pool.apply_async(gc.collect).get(60)
        assert isinstance(collected, int)
    finally:
        gc.enable()
        if pool is not None:
            pool.terminate()
            pool.join(30)


@pytest.mark.parametrize("method", ["cpu", None])
def test_the_parent_collects_only_for_fork_pools(
    method: str | None, monkeypatch: pytest.MonkeyPatch, spawn_pool: Any
) -> None:
    """Spawned workers start from nothing: collecting the parent's garbage would only cost time.

    (``spawn_pool``: the shared spawn pool has started multiprocessing's resource tracker before the leak
    check's snapshot, as the first spawn of the session would.)
    """
    calls = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or real(*a))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*multi-threaded.*fork.*", category=DeprecationWarning)
        pool = pc_pool.Pool(1) if method is None else pc_pool.Pool(1, share_method=method)
    try:
        assert pool.apply_async(abs, (-3,)).get(60) == 3
    finally:
        pool.terminate()
        pool.join(30)
    assert bool(calls) == (method == "cpu")
