"""``ReplicationCallbackDataParallel``: ``torch.nn.DataParallel`` that runs the replication callbacks.

Three device modes, chosen from ``device_ids``:

- **CUDA ids** (ints or CUDA devices; or ``None`` with CUDA present): torch's ``DataParallel`` scatter,
  replicate and gather, plus the callbacks after every replicate; replicas run in
  :func:`pc_replicate._apply.apply_replicas`, which keeps torch's per-thread device, stream and autocast
  handling and adds the abort path.
- **A CPU list** (``["cpu"] * n`` or ``[torch.device("cpu")] * n``): ``n`` thread replicas on the CPU that
  share the module's parameters (see :mod:`pc_replicate._cpu`), so callbacks and synchronized batch norm run,
  and can be tested, without a GPU.
- **Neither** (``None`` on a machine without an accelerator): as in torch, the module is called directly.

When one replica raises, ``__data_parallel_abort__(exc)`` is called on every module of every replica that
defines it (so peers blocked in a synchronisation leave), and the caller gets the original exception with a
note naming the replica.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from itertools import chain
from typing import Any, TypeVar, cast

import torch
from torch import nn

from pc_replicate import _cpu
from pc_replicate._apply import apply_replicas
from pc_replicate._pool import threads_of
from pc_replicate.callback import exec_data_parallel_replication_callback

__all__ = ["DataParallelWithCallback", "ReplicationCallbackDataParallel", "patch_replication_callback"]

T = TypeVar("T", bound=nn.Module)
DP = TypeVar("DP", bound=nn.DataParallel[Any])

DeviceId = int | str | torch.device

_CPU = torch.device("cpu")


def _is_cpu(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cpu"
    if isinstance(device, str):
        try:
            return torch.device(device).type == "cpu"
        except RuntimeError as exc:
            raise ValueError(f"device_ids contains {device!r}, which is not a device name") from exc
    if isinstance(device, int) and not isinstance(device, bool):
        return False
    raise TypeError(
        "device_ids entries must be ints, strings or torch.device objects, got "
        f"{type(device).__name__} {device!r}"
    )


def _cpu_replica_count(device_ids: object) -> int | None:
    """The number of CPU replicas ``device_ids`` asks for, or ``None`` when it is not a CPU list."""
    if device_ids is None:
        return None
    if isinstance(device_ids, (str, torch.device)) or not isinstance(device_ids, Sequence):
        raise TypeError(
            "device_ids must be a list of devices (e.g. [0, 1] or ['cpu', 'cpu']) or None, "
            f"got {device_ids!r}"
        )
    if not device_ids:
        raise ValueError("device_ids is empty; pass None for all devices, or a non-empty list of devices")
    flags = [_is_cpu(device) for device in device_ids]
    if all(flags):
        return len(flags)
    if any(flags):
        raise ValueError(
            f"device_ids mixes CPU and accelerator devices ({list(device_ids)!r}); expected all CPU (thread "
            "replicas) or all accelerator devices"
        )
    return None


class ReplicationCallbackDataParallel(nn.DataParallel[T]):
    """Data parallel with a replication callback, on CUDA devices or on CPU thread replicas.

    After every replication, each module of each replica that defines ``__data_parallel_replicate__(ctx,
    copy_id)`` is called (see :mod:`pc_replicate.callback`), copy 0 first. ``device_ids=["cpu"] * n`` runs
    ``n`` thread replicas that share the module's parameters, so a single ``backward`` accumulates into the
    module's gradients exactly as with CUDA replicas.

    Args:
        module: the module to parallelize.
        device_ids: CUDA device ids (default: all), or a list of ``n`` CPU devices for thread replicas.
        output_device: where outputs are gathered (default ``device_ids[0]``); must be the CPU for CPU
            replicas.
        dim: the dimension inputs are scattered along and outputs gathered along.

    Raises:
        TypeError: if ``module`` is not an ``nn.Module``, ``dim`` is not an int, or ``device_ids`` is not a
            list of devices.
        ValueError: if ``device_ids`` is empty or mixes CPU and accelerator devices, or ``output_device`` is
            not the CPU for CPU replicas.

    Example::

        sync_bn = SynchronizedBatchNorm1d(10, eps=1e-5, affine=False)
        sync_bn = ReplicationCallbackDataParallel(sync_bn, device_ids=["cpu", "cpu"])
        out = sync_bn(torch.randn(8, 10))  # sync_bn.__data_parallel_replicate__ ran on both replicas
    """

    def __init__(
        self,
        module: T,
        device_ids: Sequence[DeviceId] | None = None,
        output_device: DeviceId | None = None,
        dim: int = 0,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"dim must be an int, got {type(dim).__name__} {dim!r}")
        count = _cpu_replica_count(device_ids)
        if count is None:
            super().__init__(
                module,
                cast("Sequence[int | torch.device] | None", device_ids),
                cast("int | torch.device | None", output_device),
                dim,
            )
            return
        if not (output_device is None or output_device == -1 or _is_cpu(output_device)):
            raise ValueError(f"output_device must be the CPU for CPU thread replicas, got {output_device!r}")
        # DataParallel.__init__ rejects CPU ids on CUDA machines and ignores all ids on CPU-only ones.
        nn.Module.__init__(self)
        self.module = module
        # torch annotates these as ints (CUDA indices); CPU replicas store torch.device("cpu").
        self.device_ids = cast("list[int]", [_CPU] * count)
        self.output_device = cast(int, _CPU)
        self.dim = dim
        self.src_device_obj = _CPU

    def _cpu_replicas(self) -> bool:
        # getattr defaults: an instance patched from a torch-built DataParallel may lack any of these.
        src = getattr(self, "src_device_obj", None)
        return isinstance(src, torch.device) and src.type == "cpu" and bool(getattr(self, "device_ids", None))

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Scatter the inputs, replicate (running the callbacks), apply the replicas in threads, gather."""
        if not self._cpu_replicas():
            return super().forward(*inputs, **kwargs)
        with torch.autograd.profiler.record_function("ReplicationCallbackDataParallel.forward"):
            for tensor in chain(self.module.parameters(), self.module.buffers()):
                if tensor.device.type != "cpu":
                    raise RuntimeError(
                        "module must have its parameters and buffers on the CPU for CPU thread replicas, but "
                        f"found one on device {tensor.device}"
                    )
            scattered, scattered_kwargs = self.scatter(inputs, kwargs, self.device_ids)
            if not scattered and not scattered_kwargs:
                scattered, scattered_kwargs = ((),), ({},)
            if len(self.device_ids) == 1:
                return self.module(*scattered[0], **scattered_kwargs[0])
            replicas = self.replicate(self.module, self.device_ids[: len(scattered)])
            outputs = self.parallel_apply(replicas, scattered, scattered_kwargs)
            return self.gather(outputs, self.output_device)

    def replicate(self, module: T, device_ids: Sequence[DeviceId]) -> list[T]:
        """Replicate ``module`` onto ``device_ids`` and run the replication callbacks on the replicas.

        A list of CPU devices gives CPU thread replicas; anything else uses torch's ``replicate``.
        """
        if device_ids and all(_is_cpu(device) for device in device_ids):
            replicas = _cpu.replicate_cpu(module, len(device_ids))
        else:
            replicas = super().replicate(module, cast("Sequence[int | torch.device]", device_ids))
        exec_data_parallel_replication_callback(replicas)
        return replicas

    def scatter(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Sequence[DeviceId]
    ) -> Any:
        """Split the inputs into per-replica chunks along ``dim`` (torch's rules; views on the CPU)."""
        if self._cpu_replicas():
            return _cpu.scatter_kwargs(inputs, kwargs, len(device_ids), self.dim)
        return super().scatter(inputs, kwargs, cast("Sequence[int | torch.device]", device_ids))

    def parallel_apply(self, replicas: Sequence[T], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        """Run the replicas in threads; a failure in one aborts the others and is re-raised here."""
        device_type = self.src_device_obj.type
        devices: list[torch.device | None] = [
            _CPU if device_type == "cpu" else torch.device(device_type, index)
            for index in self.device_ids[: len(replicas)]
        ]
        return apply_replicas(replicas, inputs, kwargs, devices, threads=threads_of(self))

    def gather(self, outputs: Any, output_device: DeviceId) -> Any:
        """Combine the replicas' outputs along ``dim`` on ``output_device``."""
        if self._cpu_replicas():
            return _cpu.gather(outputs, self.dim)
        return super().gather(outputs, cast("int | torch.device", output_device))


#: The name Synchronized-BatchNorm-PyTorch uses for the same class (the same class object).
DataParallelWithCallback = ReplicationCallbackDataParallel


class _CallbackMixin(nn.DataParallel[Any]):
    """Runs the replication callbacks after ``replicate`` of the DataParallel subclass it is mixed into."""

    _pc_base: type[nn.DataParallel[Any]]

    def replicate(self, module: Any, device_ids: Sequence[int | torch.device]) -> list[Any]:
        replicas = super().replicate(module, device_ids)
        exec_data_parallel_replication_callback(replicas)
        return replicas

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # The patched class is created at run time and cannot be found by name: pickle the user's class and
        # the state, and patch again when loading.
        return (_rebuild_patched, (self._pc_base, self.__dict__.copy()))


_patched_classes: dict[type[Any], type[Any]] = {}
_patched_classes_lock = threading.Lock()


def _patched_class(cls: type[nn.DataParallel[Any]]) -> type[Any]:
    with _patched_classes_lock:
        patched = _patched_classes.get(cls)
        if patched is None:
            patched = type(
                f"{cls.__name__}WithCallback",
                (_CallbackMixin, cls),
                {"_pc_base": cls, "__module__": __name__, "__doc__": cls.__doc__},
            )
            _patched_classes[cls] = patched
        return patched


def _rebuild_patched(cls: type[nn.DataParallel[Any]], state: dict[str, Any]) -> nn.DataParallel[Any]:
    """Unpickling helper: rebuild a patched ``cls`` instance from its state."""
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return patch_replication_callback(obj)


def patch_replication_callback(data_parallel: DP) -> DP:
    """Give an existing ``DataParallel`` object the replication callbacks (in place) and return it.

    A plain ``torch.nn.DataParallel`` becomes a :class:`ReplicationCallbackDataParallel`; an instance of a
    ``DataParallel`` subclass ``C`` becomes an instance of a cached subclass of ``C`` whose ``replicate``
    calls ``C.replicate`` and then the callbacks (useful for a customized DataParallel). Patching is
    idempotent and the object stays picklable (``pickle``, ``torch.save``, ``copy.deepcopy``).

    Args:
        data_parallel: the ``torch.nn.DataParallel`` instance to patch.

    Returns:
        The same object, patched.

    Raises:
        TypeError: if ``data_parallel`` is not a ``torch.nn.DataParallel``.

    Example::

        sync_bn = torch.nn.DataParallel(SynchronizedBatchNorm1d(10), device_ids=[0, 1])
        sync_bn = patch_replication_callback(sync_bn)
        # equivalent to ReplicationCallbackDataParallel(SynchronizedBatchNorm1d(10), device_ids=[0, 1])
    """
    if not isinstance(data_parallel, nn.DataParallel):
        raise TypeError(
            f"patch_replication_callback expects a torch.nn.DataParallel, got {type(data_parallel).__name__}"
        )
    if isinstance(data_parallel, (ReplicationCallbackDataParallel, _CallbackMixin)):
        return data_parallel
    cls = type(data_parallel)
    patched = ReplicationCallbackDataParallel if cls is nn.DataParallel else _patched_class(cls)
    data_parallel.__class__ = cast("type[DP]", patched)
    return data_parallel
