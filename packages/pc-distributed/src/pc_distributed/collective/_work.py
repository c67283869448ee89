"""Handles of asynchronous collective operations: the any-source receive and a work with a finishing step."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pc_distributed._checks import resolve_timeout
from pc_distributed._torch_errors import is_timeout

__all__ = ["ChainedWork", "RecvHandle"]


class RecvHandle:
    """What :meth:`CollectiveGroup.irecv` returns: ``wait(timeout=None)`` returns the sender's global rank.

    ``finish`` (if given) runs once, in the first ``wait()`` that sees the receive complete: the copy of a
    host-staged receive into the caller's tensor.
    """

    def __init__(
        self,
        src: int | None,
        work: Any = None,
        timeout: float = 60.0,
        finish: Callable[[], object] | None = None,
    ) -> None:
        self._src = src
        self._work = work
        self._timeout = timeout
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._finish = finish
        self._finish_lock = threading.Lock()

    @classmethod
    def any_source(
        cls,
        tensor: torch.Tensor,
        pg: Any,
        tag: int,
        timeout: float,
        finish: Callable[[], object] | None = None,
    ) -> RecvHandle:
        """Post a receive from any source in a daemon thread (torch reveals the sender only to ``recv``)."""
        handle = cls(None, None, timeout, finish)

        def receive() -> None:
            try:
                handle._src = dist.recv(tensor, src=None, group=pg, tag=tag)
            except BaseException as exc:
                handle._error = exc
            finally:
                handle._done.set()

        threading.Thread(target=receive, name="pc-distributed-irecv", daemon=True).start()
        return handle

    def is_completed(self) -> bool:
        """Whether the receive finished (its values are in the tensor once :meth:`wait` returned)."""
        if self._work is not None and not self._done.is_set():
            return bool(self._work.is_completed())
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the tensor and return the sender's global rank (again, at once, on a later call).

        Args:
            timeout: Seconds (None or -1: the group's timeout).

        Raises:
            TimeoutError: If nothing arrived in time.
            RuntimeError: If the transport failed (e.g. the peer died).
        """
        limit = resolve_timeout(timeout, self._timeout)
        if self._work is not None:
            if not self._done.is_set():  # gloo counts completions: a second wait() of its work would block
                try:
                    self._work.wait(timeout=timedelta(seconds=limit))
                except RuntimeError as exc:
                    if is_timeout(exc):
                        what = f"irecv from rank {self._src} timed out after {limit:g} s"
                        raise TimeoutError(what) from exc
                    raise
                self._done.set()
        elif not self._done.wait(limit):
            raise TimeoutError(f"irecv from any source timed out after {limit:g} s")
        elif self._error is not None:
            raise self._error
        with self._finish_lock:
            finish, self._finish = self._finish, None
        if finish is not None:
            finish()
        assert self._src is not None
        return self._src


class ChainedWork:
    """An async handle that runs a finishing step (copy-out) after the underlying work completes."""

    def __init__(self, work: Any, finish: Callable[[], None]) -> None:
        self._work = work
        self._finish = finish
        self._finished = False

    def is_completed(self) -> bool:
        return self._finished or bool(self._work.is_completed())

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._finished:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout=timeout)
            self._finish()
            self._finished = True
        return True
