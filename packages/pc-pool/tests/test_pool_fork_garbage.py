"""A fork pool's workers must not inherit garbage that only the parent can collect.

A torch gloo process group waits, in its destructor, for worker threads of its own. If such a group sits in an
uncollected reference cycle when the pool forks a worker, the worker's garbage collector would collect its
copy of the group, whose threads do not exist in the worker: the destructor would wait forever and the task
that ran the collection would never return. The pool forks with the parent's objects frozen (``gc.freeze``),
so a worker's collections never examine them, and unfreezes them in the parent right after.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

import pc_pool


def _gloo_group_in_a_cycle() -> None:
    """Leave a gloo group whose worker threads are up in an uncollected reference cycle."""
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    group.allreduce([torch.ones(1)]).wait()  # its worker threads are up, waiting for work
    cycle: list[Any] = [group]
    cycle.append(cycle)


def _in_a_generation(obj: Any) -> bool:
    """Whether the collector examines ``obj`` (frozen objects are in none of its generations)."""
    return any(o is obj for generation in range(3) for o in gc.get_objects(generation))


def _fork_pool() -> pc_pool.Pool:
    with warnings.catch_warnings():
        # Python >= 3.12 warns when a multi-threaded process forks; fork is what share_method="cpu" asks.
        warnings.filterwarnings("ignore", message=".*multi-threaded.*fork.*", category=DeprecationWarning)
        return pc_pool.Pool(1, share_method="cpu")


def test_a_fork_worker_does_not_inherit_a_gloo_group_it_cannot_collect() -> None:
    gc.disable()  # the cycle below stays uncollected in the parent
    pool = None
    try:
        _gloo_group_in_a_cycle()
        pool = _fork_pool()
        # Were the group collectable in the worker, the worker's gc.collect() would hang in its destructor.
        collected = pool.apply_async(gc.collect).get(60)
        assert isinstance(collected, int)
    finally:
        gc.enable()
        if pool is not None:
            pool.terminate()
            pool.join(30)


def test_a_program_that_froze_its_objects_keeps_them_frozen_and_its_workers_safe() -> None:
    """``gc.freeze()`` before forking is Python's advice for fork servers: the pool must not undo it."""
    gc.disable()
    pool = None
    kept: list[Any] = []  # tracked by the collector, frozen below
    gc.freeze()
    try:
        assert not _in_a_generation(kept)
        _gloo_group_in_a_cycle()  # made after the program's freeze: not frozen by it
        pool = _fork_pool()
        assert pool.apply_async(gc.collect).get(60) >= 0
        assert gc.is_tracked(kept)
        assert not _in_a_generation(kept), "the pool unfroze what the program froze"
    finally:
        gc.unfreeze()
        gc.enable()
        if pool is not None:
            pool.terminate()
            pool.join(30)


@pytest.mark.parametrize("method", ["cpu", None])
def test_only_fork_pools_freeze_and_the_parent_is_left_unfrozen(
    method: str | None, monkeypatch: pytest.MonkeyPatch, spawn_pool: Any
) -> None:
    """Spawned workers start from nothing, so nothing is frozen for them; after a fork the parent's objects
    are collectable again (left frozen, the parent's own garbage cycles would never be freed).

    (``spawn_pool``: the shared spawn pool has started multiprocessing's resource tracker before the leak
    check's snapshot, as the first spawn of the session would.)
    """
    freezes = []
    real = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: freezes.append(gc.get_count()) or real())
    assert gc.get_freeze_count() == 0
    pool = _fork_pool() if method == "cpu" else pc_pool.Pool(1)
    try:
        assert pool.apply_async(abs, (-3,)).get(60) == 3
    finally:
        pool.terminate()
        pool.join(30)
    assert bool(freezes) == (method == "cpu")
    assert gc.get_freeze_count() == 0
