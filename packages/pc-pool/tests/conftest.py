"""Fixtures of the pc-pool tests: shared pools and an autouse leak check (fds, /dev/shm, child processes)."""

from __future__ import annotations

import gc
import os
import time
import warnings
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

import pc_pool
from pc_pool import _serial

_SHARED: list[Any] = []


def _fd_table() -> dict[int, str]:
    table = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            table[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
    return table


def _shm() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(("torch_", "sem.", "pym-"))}
    except FileNotFoundError:  # pragma: no cover - no /dev/shm
        return set()


def _targets_of(pid: int) -> set[str]:
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    targets = set()
    for name in names:
        try:
            targets.add(os.readlink(f"/proc/{pid}/fd/{name}"))
        except OSError:
            continue
    return targets


def _shared_pool_resources() -> tuple[set[int], set[str]]:
    """Pids of the shared pools' workers and the pipes they share with this process (by /proc target)."""
    pids: set[int] = set()
    targets: set[str] = set()
    for pool in _SHARED:
        for w in list(getattr(pool, "_workers", [])):
            try:
                pid = w.process.pid if w is not None else None
            except ValueError:  # closed by the pool meanwhile
                continue
            if pid is not None:
                pids.add(pid)
                targets |= {t for t in _targets_of(pid) if t.startswith("pipe:")}
    return pids, targets


def _leaks(before_fds: dict[int, str], before_children: set[int], before_shm: set[str]) -> list[str]:
    shared_pids, shared_targets = _shared_pool_resources()
    problems = []
    me = psutil.Process()
    children = [
        c for c in me.children(recursive=True) if c.pid not in before_children and c.pid not in shared_pids
    ]
    if children:
        _, alive = psutil.wait_procs(children, timeout=5)
        if alive:
            problems.append(f"children left: {[(c.pid, c.name()) for c in alive]}")
    after = _fd_table()
    # A new socket is multiprocessing's resource_sharer listener, a per-process singleton started by the first
    # fd-shared tensor; the pools themselves use pipes only.
    leaked = {
        fd: t
        for fd, t in after.items()
        if before_fds.get(fd) != t and t not in shared_targets and not t.startswith("socket:")
    }
    if leaked:
        problems.append(f"fds left: {leaked}")
    ours = (
        {str(os.getpid())}
        | {str(c.pid) for c in me.children(recursive=True)}
        | {str(p) for p in before_children}
    )
    # /dev/shm is machine-wide: only torch_<pid>_* names of this process tree count.
    shm = {n for n in _shm() - before_shm if not n.startswith("torch_") or n.split("_")[1] in ours}
    if shm:
        problems.append(f"/dev/shm entries left: {sorted(shm)}")
    return problems


_POOL_FIXTURES = {
    "Pool": "fork_pool",
    "P2PPool": "fork_p2p_pool",
    "CtxPool": "fork_ctx_pool",
    "spawn": "spawn_pool",
}


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves child processes, file descriptors or /dev/shm entries behind."""
    # Start the shared pools a test uses before the snapshot, so their workers and pipes are not "leaks".
    callspec = getattr(request.node, "callspec", None)
    params = callspec.params if callspec is not None else {}
    if "any_pool" in params:
        request.getfixturevalue(_POOL_FIXTURES[params["any_pool"]])
    if "pool_name" in params:
        request.getfixturevalue(params["pool_name"])
    for name in _POOL_FIXTURES.values():
        if name in request.fixturenames:
            request.getfixturevalue(name)
    shared_pids, _ = _shared_pool_resources()
    before_children = {c.pid for c in psutil.Process().children(recursive=True)} | shared_pids
    before_fds, before_shm = _fd_table(), _shm()
    yield
    deadline = time.monotonic() + 5
    problems = _leaks(before_fds, before_children, before_shm)
    if problems:
        gc.collect()  # shared tensors in reference cycles hold shm fds until collected (slow: only if needed)
        # A CUDA tensor the test shared and freed after the pool exited keeps torch's /dev/shm ref-count file
        # until torch next collects (it does when it shares again): torch's bookkeeping, not the pool's.
        _serial.collect_cuda_ipc()
        problems = _leaks(before_fds, before_children, before_shm)
    while problems and time.monotonic() < deadline:
        time.sleep(0.1)  # resources are released by other threads; re-check rather than fail at once
        problems = _leaks(before_fds, before_children, before_shm)
    assert not problems, "; ".join(problems)


def _make_shared(factory: Any) -> Iterator[Any]:
    with warnings.catch_warnings():
        # Python >= 3.12 warns when a multi-threaded process forks; fork is what share_method="cpu" asks for.
        warnings.filterwarnings("ignore", message=".*multi-threaded.*fork.*", category=DeprecationWarning)
        pool = factory()
    _SHARED.append(pool)
    try:
        yield pool
    finally:
        _SHARED.remove(pool)
        pool.terminate()
        pool.join(30)


@pytest.fixture(scope="session")
def fork_pool() -> Iterator[pc_pool.Pool]:
    """A shared 2-worker fork Pool; tests must not terminate it."""
    yield from _make_shared(lambda: pc_pool.Pool(2, share_method="cpu"))


@pytest.fixture(scope="session")
def fork_p2p_pool() -> Iterator[pc_pool.P2PPool]:
    """A shared 2-worker fork P2PPool."""
    yield from _make_shared(lambda: pc_pool.P2PPool(2, share_method="cpu"))


@pytest.fixture(scope="session")
def fork_ctx_pool() -> Iterator[pc_pool.CtxPool]:
    """A shared 2-worker fork CtxPool with contexts 0 and 1."""
    yield from _make_shared(lambda: pc_pool.CtxPool(2, worker_contexts=[0, 1], share_method="cpu"))


@pytest.fixture(scope="session")
def spawn_pool() -> Iterator[pc_pool.Pool]:
    """A shared 2-worker spawn Pool (the default start method; slow to start, so started once)."""
    yield from _make_shared(lambda: pc_pool.Pool(2))


@pytest.fixture(params=["Pool", "P2PPool", "CtxPool", "spawn"])
def any_pool(request: pytest.FixtureRequest) -> Any:
    """Each shared pool in turn."""
    return request.getfixturevalue(_POOL_FIXTURES[request.param])
