"""Fixtures for the pc-pickle tests: a file-descriptor leak check around every test."""

from __future__ import annotations

import gc
import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker

import pickle_testutils
import pytest
import torch

import pc_pickle


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="session", autouse=True)
def _warm_resource_sharer() -> None:
    """Open this process's long-lived sockets once, so they are not counted as leaks: multiprocessing's
    resource_sharer listener, and the connection to torch's shared-memory manager that the first load of a
    'file_system' payload opens (the strategy is set in a child only), and the pipe to multiprocessing's
    resource tracker that the first spawn opens."""
    resource_tracker.ensure_running()
    pc_pickle.loads(pc_pickle.dumps(torch.ones(1), copy_tensor=False))
    ctx = multiprocessing.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=pickle_testutils.produce_and_exit, args=(writer, "file_system"))
    proc.start()
    writer.close()
    if reader.poll(pickle_testutils.TIMEOUT):
        pc_pickle.loads(reader.recv_bytes())
    reader.close()
    proc.join(pickle_testutils.TIMEOUT)
    gc.collect()


@pytest.fixture(autouse=True)
def no_fd_leak(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves file descriptors open (shared-memory fds, pipes, sockets)."""
    if "gpu" in request.keywords and torch.cuda.is_available():
        # the CUDA context opens device files, an eventfd and pipes on first use and keeps them for the
        # process's lifetime: create it before counting
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
    before = _open_fds()
    yield
    if not _open_fds() <= before:
        gc.collect()  # only when needed: a full collection costs ~0.1 s with torch loaded
    leaked = _leaked(before)
    # A share payload loaded in this process fetches its fd from multiprocessing's resource_sharer thread,
    # which closes its end of that connection on its own schedule. Give that foreign thread a bounded moment
    # (we cannot wait on it any other way); a socket still open after that is a real leak.
    deadline = time.monotonic() + 5.0
    while leaked and all("socket:" in t for t in leaked.values()) and time.monotonic() < deadline:
        threading.Event().wait(0.02)
        leaked = _leaked(before)
    assert not leaked, f"file descriptors left open: {leaked}"


def _target(fd: str) -> str | None:
    """What descriptor ``fd`` points at, or None if another thread closed it since it was listed."""
    try:
        return os.path.realpath(f"/proc/self/fd/{fd}")
    except FileNotFoundError:
        return None


def _leaked(before: set[str]) -> dict[str, str]:
    leaked = {fd: target for fd in _open_fds() - before if (target := _target(fd)) is not None}
    # The CUDA driver opens /dev/shm/cuda.shm.<...> on a process's first CUDA IPC call and keeps it for the
    # process's lifetime (its own bookkeeping, not a tensor's storage): not ours to close.
    return {
        fd: target
        for fd, target in leaked.items()
        if os.path.exists(f"/proc/self/fd/{fd}") and not target.startswith("/dev/shm/cuda.shm.")
    }
