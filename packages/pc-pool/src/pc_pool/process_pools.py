"""The user-facing process pools: :class:`Pool`, :class:`P2PPool` and :class:`CtxPool`.

They configure :class:`~pc_pool.BasePool` from two flags:

* ``is_copy_tensor=True`` (default): every tensor that crosses (arguments, results, closures, initargs,
  contexts) is copied; worker writes never show in the caller and caller tensors never move to shared memory.
* ``is_copy_tensor=False``: tensors are shared; ``share_method`` must be ``"cpu"`` (shared memory) or
  ``"cuda"`` (CUDA IPC, ``"cuda:N"`` accepted).
* Start method: ``share_method="cpu"`` forks (fast start-up; no CUDA in workers if the parent
  initialised it); everything else spawns. The sharing strategy of torch is never changed.
"""

from __future__ import annotations

import multiprocessing
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from pc_pool._checks import bool_flag
from pc_pool.base_pool import BasePool
from pc_pool.worker import CtxPoolStorage, proxy_ctx_caller

__all__ = ["CtxPool", "P2PPool", "Pool"]


def _check_share(is_copy_tensor: bool, share_method: str | None) -> tuple[bool, str]:
    """Validate the tensor flags; return ``(copy, start_method)``."""
    bool_flag("is_copy_tensor", is_copy_tensor)
    valid = (
        share_method is None
        or share_method in ("cpu", "cuda")
        or (isinstance(share_method, str) and share_method.startswith("cuda:") and share_method[5:].isdigit())
    )
    if not valid:
        raise ValueError(f'share_method must be None, "cpu", "cuda" or "cuda:N", got {share_method!r}')
    if not is_copy_tensor and share_method is None:
        raise ValueError('is_copy_tensor=False needs share_method="cpu" or "cuda" (got share_method=None)')
    copy = is_copy_tensor
    if not copy and not sys.platform.startswith("linux"):
        warnings.warn("tensor sharing is supported on Linux only; pc_pool copies tensors here", stacklevel=3)
        copy = True
    return copy, "fork" if share_method == "cpu" else "spawn"


class Pool(BasePool):
    """Enhanced multiprocessing pool for PyTorch: lambdas, tensor copy or share, and no hangs.

    Work is balanced dynamically: an idle worker takes the next chunk.

    Note:
        To share "cpu" tensors in shared memory, set ``is_copy_tensor=False, share_method="cpu"``; to share
        "cuda" tensors, set ``is_copy_tensor=False, share_method="cuda"``. ``share_method="cpu"`` uses fork;
        otherwise workers are spawned. A worker keeps the CUDA storages it received for its last task until
        the next task's arguments are loaded, so sending the same CUDA tensor again reuses its opened IPC
        handle; the caller's CUDA block stays referenced until then (or until the worker exits).

    Args:
        processes: Number of processes in the pool (default ``os.cpu_count()``).
        initializer: Initializer function executed by each worker.
        initargs: Args passed to the init function.
        maxtasksperchild: Maximum number of tasks (chunks) per worker process; ``None`` means no limit.
        is_recursive: Pickle the globals referenced by by-value functions of importable modules by value
            too (needed for a module global created after a fork pool started). Functions and lambdas
            defined in ``__main__`` always carry the ``__main__`` globals they reference by value.
        is_daemon: Start workers as daemon processes (a task then cannot create a pool of its own).
        is_copy_tensor: Copy tensors (``True``) or pass them by reference (``False``).
        share_method: ``"cpu"`` or ``"cuda"`` (``"cuda:N"``); required when ``is_copy_tensor=False``.

    Raises:
        ValueError: Invalid counts, or an invalid or missing ``share_method``.
        TypeError: ``initializer`` is not callable.

    Examples:
        >>> import torch  # doctest: +SKIP
        >>> with Pool(2, share_method="cpu") as pool:
        ...     pool.map(lambda t: float(t.sum()), [torch.ones(3) * i for i in range(3)])
        [0.0, 3.0, 6.0]
    """

    def __init__(
        self,
        processes: int | None = None,
        initializer: Callable[..., object] | None = None,
        initargs: Iterable[Any] = (),
        maxtasksperchild: int | None = None,
        is_recursive: bool = False,
        is_daemon: bool = True,
        is_copy_tensor: bool = True,
        share_method: str | None = None,
    ) -> None:
        copy, method = _check_share(is_copy_tensor, share_method)
        self._copy_tensor = copy
        self._recurse = bool(is_recursive)
        self._daemon = bool(is_daemon)
        self._share_method = share_method
        super().__init__(
            processes, initializer, initargs, maxtasksperchild, multiprocessing.get_context(method)
        )


class P2PPool(Pool):
    """A pool where chunk k goes to worker k mod n, with no work stealing.

    Useful when each worker holds state (a model, a CUDA device) that tasks rely on. A replacement worker
    keeps the index, so chunks pinned to a dead worker go to its replacement. :meth:`close` drains pending
    work.

    Args: as :class:`Pool`.
    """

    _p2p = True


class CtxPool(Pool):
    """Pool with a context for each worker: worker i calls ``func(worker_contexts[i], *args)``.

    Your function must accept the context as its first positional argument; without ``worker_contexts`` the
    context is ``None``. A replacement worker keeps the index, and so the context, of the worker it replaces.
    Contexts obey ``is_copy_tensor`` like arguments do.

    Args:
        processes: Number of processes in the pool.
        initializer: Initializer function executed by each worker (after its context is set).
        initargs: Args passed to the init function.
        maxtasksperchild: Maximum number of tasks per worker process.
        worker_contexts: One context per worker; ``len(worker_contexts)`` must equal ``processes``.
        is_recursive: As in :class:`Pool`.
        is_daemon: As in :class:`Pool`.
        is_copy_tensor: As in :class:`Pool`.
        share_method: As in :class:`Pool`.

    Raises:
        ValueError: ``Context number is not equal to the number of pool workers.``
    """

    def __init__(
        self,
        processes: int,
        initializer: Callable[..., object] | None = None,
        initargs: Iterable[Any] = (),
        maxtasksperchild: int | None = None,
        worker_contexts: Sequence[Any] | None = None,
        is_recursive: bool = False,
        is_daemon: bool = True,
        is_copy_tensor: bool = True,
        share_method: str | None = None,
    ) -> None:
        if worker_contexts is not None:
            worker_contexts = list(worker_contexts)
            if not isinstance(processes, int) or len(worker_contexts) != processes:
                raise ValueError(
                    "Context number is not equal to the number of pool workers. "
                    f"(got {len(worker_contexts)} contexts for processes={processes!r})"
                )
        self._contexts = worker_contexts
        super().__init__(
            processes,
            initializer,
            initargs,
            maxtasksperchild,
            is_recursive,
            is_daemon,
            is_copy_tensor,
            share_method,
        )

    def _worker_context(self, index: int) -> Any:
        return None if self._contexts is None else self._contexts[index]

    def _submit(self, func: Callable[..., Any], mode: int, chunks: list[list[Any]], result: Any) -> None:
        super()._submit(_CtxCall(func), mode, chunks, result)

    def _open_job(self, func: Callable[..., Any], mode: int, result: Any) -> Any:
        return super()._open_job(_CtxCall(func), mode, result)


class _CtxCall:
    """``func`` bound to the worker's context at call time (pickles as the function it wraps)."""

    __slots__ = ("func",)

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func

    def __call__(self, *args: Any, **kwds: Any) -> Any:
        if kwds:
            return self.func(CtxPoolStorage.storage, *args, **kwds)
        return proxy_ctx_caller(self.func, *args)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_CtxCall, (self.func,))
