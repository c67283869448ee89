"""Helpers of the staging tests: a counting CPU buffer allocator and a fake copy that is already done."""

from __future__ import annotations

import threading

import torch


class CountingAllocator:
    """Makes CPU buffers and counts them (thread-safe)."""

    def __init__(self, fail: bool = False) -> None:
        self.made = 0
        self.fail = fail
        self._lock = threading.Lock()

    def __call__(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            if self.fail:
                raise RuntimeError("cannot pin memory")
            self.made += 1
        return torch.empty((nbytes,), dtype=torch.uint8)


class DoneEvent:
    """A fake event of a copy that finished when it was started (the CPU's copies are synchronous)."""

    def synchronize(self) -> None:
        pass
