"""How the c10d RPC backend pickles calls and results: by name where a name loads, tensors beside the pickle.

torch's RPC pickles with plain pickle: functions and classes travel by name, ``__main__``'s included (every
member of a job runs the same script, so the name loads there and the call runs the member's own function on
the member's own globals). Lambdas, closures and classes defined in functions have no name that loads, and
plain pickle refuses them; pc-pickle carries those by value. pc-pickle would also carry ``__main__``
definitions by value, with a copy of the sender's globals: the same call would then run on other data than on
TensorPipe. So :func:`encode` pickles the graph with plain pickle and sets aside, by ``persistent_id``:

- **host tensors** (plain ``torch.Tensor``, strided, on the CPU): by their storage. A storage of
  :data:`PART_MIN_BYTES` or more becomes a *part* of the message: the storage's own memory, sent by the frame
  layer as a message of its own without being copied into the pickle, and received into fresh memory that the
  rebuilt tensors own (no copy out of a receive buffer). A smaller storage rides inside the pickle as bytes
  (a copy of a few kilobytes costs less than one more message). Tensors that share a storage still share one
  on arrival; a tensor that views less than half of a large storage sends a compact copy of its own elements
  instead of the whole storage.
- **CUDA tensors** (plain, strided): the same, through the host. A storage is copied once from the device into
  host memory (pinned when it becomes a part, so the copy runs at the bus's speed), which then travels like
  a host storage; the receiver copies it once onto the device of the same index. gloo's point-to-point ops
  can only read host memory, so one copy out and one copy in is the least a CUDA tensor costs on this
  transport. A receiver that lacks the device gets a :class:`ValueError` naming it.
- **everything else plain pickle should not carry itself**: functions and classes that have no loadable name,
  other tensors (subclasses such as ``nn.Parameter``; sparse and quantized ones; other device types) and
  bare storages. They go by value with pc-pickle, in one blob inside the head.

An :class:`Encoded` message is a *head* (bytes) and its *parts* (uint8 host tensors). Three head forms:

- ``b"R"`` + a plain pickle: nothing by value (a small call is this one pickle);
- ``b"V"`` + the blob's length (8 bytes, little-endian) + the pc-pickle blob of the by-value objects + the
  plain pickle that refers to them;
- ``b"W"`` + a pc-pickle blob of the whole object: plain pickle refused something elsewhere in the graph (an
  object only dill knows how to pickle), so everything goes by value.

A part is read from the tensor's memory when the frame is sent, which is after :func:`encode` returns: the
caller decides whether to send the parts as they are or :meth:`Encoded.snapshot` them first (see the
transport).
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
import types
from typing import Any, NamedTuple, TypeGuard

import torch

import pc_pickle
from pc_distributed.rpc._c10d.memory import host_view

__all__ = ["PART_MIN_BYTES", "Encoded", "decode", "encode"]

PART_MIN_BYTES = 64 << 10
"""Storages of at least this many bytes travel as parts; smaller ones are copied into the pickle."""

_PLAIN, _BY_VALUE, _WHOLE = b"R", b"V", b"W"
_LENGTH = struct.Struct("<Q")
_SET_ASIDE: tuple[type, ...] = (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)
# Types whose objects plain pickle always carries itself: the pickler asks about every object it pickles, and
# most of a call is these (a call's tuple, its names, its numbers), so they are answered without a look.
# A tensor's persistent id holds its dtype, and a small storage's bytes as a PickleBuffer.
_ALWAYS_PLAIN = frozenset(
    (str, bytes, int, float, bool, type(None), tuple, list, dict, torch.dtype, pickle.PickleBuffer)
)


class Encoded(NamedTuple):
    """A pickled message: the head's bytes and the parts (contiguous uint8 host tensors) that follow it.

    ``staged`` holds the indices of the parts that are pinned host copies of CUDA storages: copies made for
    this message (no later write to the sender's tensors reaches them), which the receiver copies onto a
    device (so it receives them into pinned memory too).
    """

    head: bytes
    parts: tuple[torch.Tensor, ...] = ()
    staged: frozenset[int] = frozenset()

    def snapshot(self) -> Encoded:
        """The same message with parts of its own: copies, which later writes to the tensors do not reach."""
        if len(self.staged) == len(self.parts):
            return self
        return self._replace(
            parts=tuple(p if i in self.staged else p.clone() for i, p in enumerate(self.parts))
        )


def _loads_by_name(obj: Any) -> bool:
    """Whether ``obj`` (a function or class) is found again under its module and qualified name."""
    module_name = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module_name, str) or not isinstance(qualname, str) or "<" in qualname:
        return False
    target: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    return target is obj


def _is_plain_tensor(obj: object) -> TypeGuard[torch.Tensor]:
    """Whether ``obj`` is a plain strided tensor on the host or a CUDA device (set aside by its storage)."""
    return (
        type(obj) is torch.Tensor
        and obj.device.type in ("cpu", "cuda")
        and obj.layout == torch.strided
        and not obj.is_quantized
        and not obj.is_nested
        and not (obj.dtype.is_complex and obj.is_conj())  # only complex tensors have the conjugate bit
        and not obj.is_neg()
    )


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of ``storage``'s memory, on the storage's device (no copy).

    A host storage's is made in one tensor op over its :func:`~.memory.host_view` (each op releases the
    GIL, see there), a device storage's in two.
    """
    if storage.device.type == "cpu":
        return torch.frombuffer(host_view(storage), dtype=torch.uint8)
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _to_host(data: torch.Tensor) -> torch.Tensor:
    """A host copy of the device bytes ``data``: pinned when it will travel as a part (a full-speed copy)."""
    host = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=data.numel() >= PART_MIN_BYTES)
    host.copy_(data)  # synchronous: ordered after the work queued on the tensor's current stream
    return host


def _device_for(name: str) -> torch.device:
    """The CUDA device ``name`` of an arriving tensor, checked to exist in this process."""
    device = torch.device(name)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (device.index or 0) >= count:
        raise ValueError(
            f"a tensor arrived for {name}, but this process sees {count} CUDA device(s): send it from a "
            "device the receiver has, or move it to the CPU first"
        )
    return device


def _span_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the storage that ``tensor`` reaches, from its offset to its last element."""
    if tensor.numel() == 0:
        return 0
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return (last + 1) * tensor.element_size()


class _SetAsidePickler(pickle.Pickler):
    """Plain pickle that sets tensors, storages and nameless functions and classes aside (see the module)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=5)
        self.by_value: list[Any] = []
        self.parts: list[torch.Tensor] = []
        self.staged: set[int] = set()  # indices of parts that are host copies of device storages
        self._seen: dict[int, Any] = {}  # id of an object set aside -> its persistent id when seen again
        self._storages: dict[tuple[torch.device, int, int], int] = {}  # (device, address, bytes) -> key
        self._alive: list[Any] = []  # what was set aside stays alive while pickling, so ids stay unique

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) in _ALWAYS_PLAIN or not (
            isinstance(obj, _SET_ASIDE)
            or (isinstance(obj, (types.FunctionType, type)) and not _loads_by_name(obj))
        ):
            return None
        again = self._seen.get(id(obj))
        if again is not None:
            return again
        self._alive.append(obj)
        if _is_plain_tensor(obj):
            key = len(self._seen)
            pid = self._tensor_pid(key, obj)
            self._seen[id(obj)] = ("s", key)
            return pid
        self._seen[id(obj)] = pid = ("v", len(self.by_value))
        self.by_value.append(obj)
        return pid

    def _tensor_pid(self, key: int, tensor: torch.Tensor) -> tuple[Any, ...]:
        storage = tensor.untyped_storage()
        address = (tensor.device, storage.data_ptr(), storage.nbytes())
        offset, stride = tensor.storage_offset(), tensor.stride()
        skey = self._storages.get(address)
        source: Any = None  # None: a storage sent before in this message (the receiver has it by skey)
        if skey is None:
            if storage.nbytes() >= PART_MIN_BYTES and 2 * _span_bytes(tensor) < storage.nbytes():
                # a small view of a large storage: send a compact copy of its elements, not the storage
                tensor = tensor.detach().clone(memory_format=torch.contiguous_format)
                storage, offset, stride = tensor.untyped_storage(), 0, tensor.stride()
                address = (tensor.device, storage.data_ptr(), storage.nbytes())
                self._alive.append(tensor)
            skey = self._storages[address] = len(self._storages)
            on_device = tensor.device.type != "cpu"
            if storage.nbytes() >= PART_MIN_BYTES:
                source = len(self.parts)
                self.parts.append(_to_host(_bytes_of(storage)) if on_device else _bytes_of(storage))
                if on_device:
                    self.staged.add(source)
            else:  # pickled straight from the storage's (or its host copy's) memory, loaded as a bytearray
                # (the pickler copies a buffer's bytes into the stream as it saves it; the view keeps the
                # host copy alive until then)
                memory = _to_host(_bytes_of(storage)) if on_device else storage
                source = pickle.PickleBuffer(host_view(memory))
        return (
            "t",
            key,
            skey,
            source,
            tensor.dtype,
            tuple(tensor.shape),
            stride,
            offset,
            tensor.requires_grad,
            None if tensor.device.type == "cpu" else str(tensor.device),
        )


class _PutBackUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, by_value: list[Any], parts: tuple[torch.Tensor, ...]) -> None:
        super().__init__(file)
        self._by_value = by_value
        self._parts = parts
        self._objects: dict[int, Any] = {}
        self._storages: dict[int, torch.UntypedStorage] = {}

    def persistent_load(self, pid: Any) -> Any:
        tag = pid[0]
        if tag == "v":
            return self._by_value[pid[1]]
        if tag == "s":
            return self._objects[pid[1]]
        _, key, skey, source, dtype, shape, stride, offset, requires_grad, device = pid
        storage = self._storages.get(skey)
        if storage is None:
            storage = self._storages[skey] = self._storage(source, device)
        tensor = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, shape, stride)
        if requires_grad:
            tensor.requires_grad_(True)
        self._objects[key] = tensor
        return tensor

    def _storage(self, source: Any, device: str | None) -> torch.UntypedStorage:
        if isinstance(source, int):
            part = self._parts[source]
        elif source:  # a bytearray of the storage's bytes: the storage keeps it (no copy)
            part = torch.frombuffer(source, dtype=torch.uint8)
        else:
            part = torch.empty(0, dtype=torch.uint8)
        if device is not None:  # the host copy of a CUDA storage: copied once onto the same device
            part = part.to(_device_for(device))
        return part.untyped_storage()


def encode(obj: Any, what: str) -> Encoded:
    """The message of ``obj`` (see the module for its forms); the parts still read the tensors' memory.

    Raises:
        TypeError: If something in ``obj`` can be pickled neither way; the message names ``what`` and, from
            pc-pickle, the access path of the object.
    """
    buffer = io.BytesIO()
    buffer.write(_PLAIN)
    pickler = _SetAsidePickler(buffer)
    try:
        pickler.dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError):
        return Encoded(_WHOLE + _by_value(obj, what))
    parts, staged = tuple(pickler.parts), frozenset(pickler.staged)
    if not pickler.by_value:
        return Encoded(buffer.getvalue(), parts, staged)
    blob = _by_value(pickler.by_value, what)
    plain = buffer.getbuffer()[len(_PLAIN) :]
    return Encoded(b"".join((_BY_VALUE, _LENGTH.pack(len(blob)), blob, plain)), parts, staged)


def _by_value(obj: Any, what: str) -> bytes:
    try:
        return pc_pickle.dumps(obj)
    except pc_pickle.UnpicklableObjectError as exc:
        raise TypeError(f"{what} cannot be pickled: {exc}") from exc


def decode(head: memoryview, parts: tuple[torch.Tensor, ...] = ()) -> Any:
    """The object :func:`encode` wrote into ``head`` and ``parts`` (its tensors own the parts' memory).

    Raises:
        ValueError: If ``head`` is not a message of this codec.
    """
    form = bytes(head[:1])
    if form == _WHOLE:
        return pc_pickle.loads(head[1:])
    by_value: list[Any] = []
    start = 1
    if form == _BY_VALUE:
        (length,) = _LENGTH.unpack_from(head, 1)
        start = 1 + _LENGTH.size + length
        by_value = pc_pickle.loads(head[1 + _LENGTH.size : start])
    elif form != _PLAIN:
        raise ValueError(f"not a message of the c10d codec (form {form!r})")
    return _PutBackUnpickler(io.BytesIO(head[start:]), by_value, parts).load()
