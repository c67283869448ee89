"""A worker keeps the CUDA storages of its last task's arguments until the next task's arguments are loaded.

torch reuses an opened CUDA IPC handle only while the receiving process holds the storage it opened it for, so
this is what lets a caller that sends the same CUDA tensor task after task open its handle once. On CPU the
storages are stood in for by objects that ``_serial.loads`` reports as opened; the GPU test counts real handle
opens.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pool_testutils as tu
import pytest
import torch

import pc_pickle
import pc_pool
from pc_pool import _serial
from pc_pool.worker import _LastArguments


class _Stand:
    """Stands for a CUDA storage a load opened from a share handle."""

    def __init__(self, n: int) -> None:
        self.n = n


# State of the stand-in loads, per process (a forked worker starts with the parent's, empty, copy).
_STANDS: list[weakref.ref[_Stand]] = []
_ALIVE_AT_LOAD: list[list[bool]] = []  # per load: which earlier stand-ins were alive while it ran
_RELEASE_LOG: list[str] = []  # [path]: a file each stand-in's release appends its number to (forked workers)


def _alive() -> list[bool]:
    return [ref() is not None for ref in _STANDS]


def _note_release(path: str, n: int) -> None:
    with open(path, "a") as f:
        f.write(f"{n}\n")


def _loads_with_stand_ins(real: Any) -> Any:
    """A ``_serial.loads`` that also reports one stand-in per load into ``opened_cuda`` (when asked)."""

    def loads(data: bytes, *, opened_cuda: list[Any] | None = None) -> Any:
        items = real(data, opened_cuda=opened_cuda)
        if opened_cuda is not None:
            _ALIVE_AT_LOAD.append(_alive())
            stand = _Stand(len(_STANDS))
            if _RELEASE_LOG:
                finalizer = weakref.finalize(stand, _note_release, _RELEASE_LOG[0], stand.n)
                finalizer.atexit = False  # only a real release counts, not the interpreter's exit
            _STANDS.append(weakref.ref(stand))
            opened_cuda.append(stand)
        return items

    return loads


@pytest.fixture
def stand_in_loads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """Install the stand-in loads (before a pool forks its workers); yield the release log's path."""
    log = tmp_path / "released"
    log.touch()
    monkeypatch.setattr(_serial, "loads", _loads_with_stand_ins(_serial.loads))
    _RELEASE_LOG[:] = [str(log)]
    yield log
    _STANDS.clear()
    _ALIVE_AT_LOAD.clear()
    _RELEASE_LOG.clear()


def _report(x: torch.Tensor) -> tuple[list[list[bool]], list[bool]]:
    """Task: which stand-ins were alive during each load so far, and which are alive now."""
    return [list(seen) for seen in _ALIVE_AT_LOAD], _alive()


def _released(log: Path) -> list[int]:
    return [int(line) for line in log.read_text().split()]


def _fork_pool(**kwargs: Any) -> pc_pool.Pool:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*multi-threaded.*fork.*", category=DeprecationWarning)
        return pc_pool.Pool(1, share_method="cpu", is_copy_tensor=False, **kwargs)


# ------------------------------------------------------------------------------------------------------------
# The holder on its own
# ------------------------------------------------------------------------------------------------------------
def test_last_arguments_keeps_one_task_until_the_next_load(stand_in_loads: Path) -> None:
    last = _LastArguments()
    blob = _serial.dumps((torch.zeros(2),), copy_tensor=True)  # a pc_pickle payload, as share tasks send
    assert torch.equal(last.load(blob)[0], torch.zeros(2))
    assert _alive() == [True]  # kept after the load, while nothing else holds it
    last.load(blob)
    assert _ALIVE_AT_LOAD == [[], [True]]  # the first was still held while the second load ran...
    assert _alive() == [False, True]  # ...and dropped right after it
    last.release()
    assert _alive() == [False, False]


def test_last_arguments_drops_the_previous_task_when_a_load_fails(stand_in_loads: Path) -> None:
    last = _LastArguments()
    last.load(_serial.dumps((torch.zeros(2),), copy_tensor=True))
    assert _alive() == [True]
    with pytest.raises(pc_pickle.PayloadError):
        last.load(b"not a payload")
    assert _alive() == [False]  # bounded: a failed load keeps nothing, not the task before it


# ------------------------------------------------------------------------------------------------------------
# In a worker process
# ------------------------------------------------------------------------------------------------------------
def test_pool_worker_keeps_the_last_task_arguments_until_the_next_load(stand_in_loads: Path) -> None:
    with _fork_pool() as pool:
        t = torch.zeros(3)
        first = pool.apply_async(_report, (t,)).get(tu.T)
        second = pool.apply_async(_report, (t,)).get(tu.T)
        third = pool.map_async(_report, [t]).get(tu.T)[0]
        assert first == ([[]], [True])
        assert second == ([[], [True]], [False, True])  # kept during the next load, dropped once it is done
        assert third == ([[], [True], [False, True]], [False, False, True])
        assert _released(stand_in_loads) == [0, 1]
        pool.close()
        pool.join(tu.T)
    assert _released(stand_in_loads) == [0, 1, 2]  # the exit request drops the last task's


def test_pool_worker_drops_the_kept_arguments_on_terminate(stand_in_loads: Path) -> None:
    pool = _fork_pool()
    try:
        assert pool.apply_async(_report, (torch.zeros(3),)).get(tu.T) == ([[]], [True])
        assert _released(stand_in_loads) == []  # idle, still keeping them
    finally:
        pool.terminate()  # SIGTERM: the worker unwinds, then dies of the signal, skipping interpreter exit
        pool.join(tu.T)
    assert _released(stand_in_loads) == [0]


def test_pool_copy_mode_keeps_nothing(stand_in_loads: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*multi-threaded.*fork.*", category=DeprecationWarning)
        pool = pc_pool.Pool(1, share_method="cpu")
    with pool:
        assert pool.apply_async(_report, (torch.zeros(3),)).get(tu.T) == ([], [])  # copies hold no handle


# ------------------------------------------------------------------------------------------------------------
# CUDA (run by ``nox -s gpu``)
# ------------------------------------------------------------------------------------------------------------
_OPENS: list[int] = [0]


def _count_handle_opens() -> None:
    """Initializer: count the CUDA IPC handles this worker opens (torch's ``_new_shared_cuda``)."""
    real = torch.UntypedStorage._new_shared_cuda  # type: ignore[attr-defined]

    def counting(*args: Any, **kwargs: Any) -> Any:
        _OPENS[0] += 1
        return real(*args, **kwargs)

    torch.UntypedStorage._new_shared_cuda = staticmethod(counting)  # type: ignore[attr-defined]


def _add_one_and_count(t: torch.Tensor) -> tuple[int, int]:
    t.add_(1)
    torch.cuda.synchronize()  # the write is done before the caller is answered
    return _OPENS[0], os.getpid()


def _sum_and_count(t: torch.Tensor) -> tuple[float, int]:
    return float(t.sum().item()), _OPENS[0]


@pytest.mark.gpu
def test_pool_cuda_same_tensor_twice_opens_its_handle_once() -> None:
    with pc_pool.Pool(1, is_copy_tensor=False, share_method="cuda", initializer=_count_handle_opens) as pool:
        t = torch.zeros(1 << 20, device="cuda")  # 4 MB
        opens_1, pid_1 = pool.apply_async(_add_one_and_count, (t,)).get(tu.T)
        opens_2, pid_2 = pool.apply_async(_add_one_and_count, (t,)).get(tu.T)
        assert pid_1 == pid_2
        assert (opens_1, opens_2) == (1, 1)  # the second task reused the handle the first one opened
        assert torch.equal(t, torch.full_like(t, 2.0))  # both in-place writes show in the caller
        other = torch.zeros(4, device="cuda")
        opens_3, _ = pool.apply_async(_add_one_and_count, (other,)).get(tu.T)
        assert opens_3 == 2  # another storage opens its own handle
        assert torch.equal(other.cpu(), torch.ones(4))
        # A reused handle still waits for the caller's writes queued before the send: hold the caller's stream
        # busy, queue a write behind it and send at once; the worker must read the written value.
        if hasattr(torch.cuda, "_sleep"):
            _, opens_4 = pool.apply_async(_sum_and_count, (t,)).get(tu.T)  # the worker holds t's storage
            assert opens_4 == 3  # it was dropped after the task with another tensor: opened again
            torch.cuda._sleep(1 << 30)  # about half a second of GPU time on the caller's stream
            t.fill_(3.0)
            total, opens_5 = pool.apply_async(_sum_and_count, (t,)).get(tu.T)
            assert opens_5 == 3  # reused, not reopened (a reopen would wait for the event by itself)
            assert total == 3.0 * t.numel()
