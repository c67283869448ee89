"""Helpers shared by the pc-distributed tests."""

from __future__ import annotations

import psutil
import torch


def fork_unless_cuda() -> str:
    """``"fork"`` (fast start), or ``"spawn"`` where CUDA is available (a GPU machine's run).

    TensorPipe opens CUDA channels whenever CUDA is present, and CUDA cannot start in a child forked after the
    parent initialized its driver, so RPC would not start in a forked rank there (run_world refuses it).
    """
    return "spawn" if torch.cuda.is_available() else "fork"


class Children:
    """The child processes a test started: those it has now that it did not have when it began.

    Children the process already had (other suites' session-scoped pools in one pytest run) and
    multiprocessing's own helpers (resource tracker, forkserver) are not the test's.
    """

    def __init__(self) -> None:
        self._earlier = {child.pid for child in psutil.Process().children(recursive=True)}

    def new(self) -> list[psutil.Process]:
        """The test's children still alive (create the object as the test begins)."""
        out = []
        for child in psutil.Process().children(recursive=True):
            if child.pid in self._earlier:
                continue
            try:
                cmd = " ".join(child.cmdline())
            except psutil.Error:
                continue
            if "resource_tracker" in cmd or "forkserver" in cmd:
                continue
            out.append(child)
        return out
