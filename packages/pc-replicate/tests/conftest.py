"""Fixtures for the pc-replicate tests."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest


def _our_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pc-replicate")]


@pytest.fixture
def no_thread_leak() -> Iterator[None]:
    """Fail the test if a pc-replicate thread it started is still alive 5 s after it ended.

    A module's replica threads end when the module is collected; a test's exception traceback can hold it in
    a reference cycle, so the collector runs first.
    """
    before = set(_our_threads())
    yield
    gc.collect()
    leaked = [t for t in _our_threads() if t not in before]
    for thread in leaked:
        thread.join(5.0)
    alive = [t.name for t in leaked if t.is_alive()]
    assert not alive, f"threads left running: {alive}"


@pytest.fixture(autouse=True)
def one_intra_op_thread() -> Iterator[None]:
    """Run each test with one intra-op thread, as the docs advise for thread replicas on few cores.

    Several replica threads that each start an OpenMP team oversubscribe a small, shared machine and make
    every op, even in the caller's thread, much slower; the previous setting is restored afterwards.
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
