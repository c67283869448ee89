"""Thread-local torch state: capture it in the caller, re-enter it in a worker thread.

Grad mode, inference mode and autocast are thread-local in PyTorch, so a worker thread starts with the
defaults (grad on, no inference mode, no autocast) whatever its caller had. Both the replica apply and
``Parallel`` capture the caller's state with :func:`capture` and wrap the worker's call in
:meth:`ThreadState.enter`. The CUDA device and stream are captured per call site (they depend on the replica's
device, not on the caller).

This is the package's thin layer over those torch calls, so a change in torch touches this file only.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

__all__ = [
    "AUTOCAST_DEVICE_TYPES",
    "ThreadState",
    "capture",
    "cuda_context",
    "current_stream",
    "find_cuda_device",
    "thread_is_default",
]

#: Device types whose autocast state is carried into worker threads.
AUTOCAST_DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda")


@dataclass(frozen=True)
class ThreadState:
    """The caller's grad, inference and autocast state, to be re-entered in another thread.

    Attributes:
        grad_enabled: ``torch.is_grad_enabled()`` in the caller.
        inference_mode: ``torch.is_inference_mode_enabled()`` in the caller.
        autocast: device type -> autocast dtype, for each device type whose autocast was enabled.
        autocast_cache: ``torch.is_autocast_cache_enabled()`` in the caller.
        num_threads: ``torch.get_num_threads()`` in the caller.
    """

    grad_enabled: bool
    inference_mode: bool
    autocast: Mapping[str, torch.dtype]
    autocast_cache: bool
    num_threads: int

    @property
    def is_default(self) -> bool:
        """Whether this is a fresh thread's state (grad on, no inference mode, no autocast)."""
        return self.grad_enabled and not self.inference_mode and not self.autocast

    def enter(self) -> contextlib.AbstractContextManager[None]:
        """Re-enter this state in the current thread for the duration of the ``with`` block."""
        _sync_intra_op_threads(self.num_threads)
        if self.is_default and thread_is_default():
            return contextlib.nullcontext()  # fast path: nothing to change
        return self._enter()

    @contextlib.contextmanager
    def _enter(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.inference_mode:
                stack.enter_context(torch.inference_mode(True))
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for device_type, dtype in self.autocast.items():
                stack.enter_context(
                    torch.autocast(device_type, dtype=dtype, enabled=True, cache_enabled=self.autocast_cache)
                )
            yield


_local = threading.local()


@functools.cache
def _openmp_backend() -> bool:
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def _sync_intra_op_threads(num_threads: int) -> None:
    # With the OpenMP backend, a thread that did not call torch.set_num_threads itself runs its ops with the
    # OpenMP/MKL default (all cores), whatever the caller set: on 2 cores, two replica threads then start
    # OpenMP teams whose spinning made a 2-replica step many times slower (docs/replicate.md).
    # Re-applying the caller's (global) value in the worker is a no-op for every other thread. The native
    # backend keeps one global pool and warns on a second set_num_threads, so it is left alone.
    if getattr(_local, "num_threads", None) == num_threads:
        return
    if _openmp_backend():
        torch.set_num_threads(num_threads)
    _local.num_threads = num_threads


def thread_is_default() -> bool:
    """Whether this thread has a fresh thread's torch state: grad on, no inference mode, no autocast."""
    return (
        torch.is_grad_enabled()
        and not torch.is_inference_mode_enabled()
        and not any(torch.is_autocast_enabled(device_type) for device_type in AUTOCAST_DEVICE_TYPES)
    )


def capture() -> ThreadState:
    """Capture the calling thread's grad, inference and autocast state.

    Returns:
        A :class:`ThreadState` that can be re-entered in another thread.
    """
    autocast = {
        device_type: torch.get_autocast_dtype(device_type)
        for device_type in AUTOCAST_DEVICE_TYPES
        if torch.is_autocast_enabled(device_type)
    }
    return ThreadState(
        grad_enabled=torch.is_grad_enabled(),
        inference_mode=torch.is_inference_mode_enabled(),
        autocast=autocast,
        autocast_cache=torch.is_autocast_cache_enabled(),
        num_threads=torch.get_num_threads(),
    )


def find_cuda_device(obj: object) -> torch.device | None:
    """Return the device of the first CUDA tensor found in ``obj`` (tensors, tuples, lists, dict values)."""
    if isinstance(obj, torch.Tensor):
        return obj.device if obj.is_cuda else None
    if isinstance(obj, (list, tuple)):
        for item in obj:
            found = find_cuda_device(item)
            if found is not None:
                return found
    elif isinstance(obj, dict):
        for item in obj.values():
            found = find_cuda_device(item)
            if found is not None:
                return found
    return None


def current_stream(device: torch.device | None) -> torch.cuda.Stream | None:
    """The calling thread's current stream on ``device`` when it is a CUDA device, else ``None``."""
    if device is None or device.type != "cuda":
        return None
    return torch.cuda.current_stream(device)


@contextlib.contextmanager
def cuda_context(device: torch.device | None, stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Make ``device`` current and enter ``stream``; a no-op for ``None`` or a non-CUDA device."""
    if device is None or device.type != "cuda":
        yield
        return
    with torch.cuda.device(device), torch.cuda.stream(stream):
        yield
