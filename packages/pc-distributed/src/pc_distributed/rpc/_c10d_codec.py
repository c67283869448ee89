"""How the c10d RPC backend pickles calls and results: by name where a name loads, by value where not.

torch's RPC pickles with plain pickle: functions and classes travel by name, ``__main__``'s included (every
member of a job runs the same script, so the name loads there and the call runs the member's own function on
the member's own globals). Lambdas, closures and classes defined in functions have no name that loads, and
plain pickle refuses them. pc-pickle carries those by value, and moves tensors faster than plain pickle does
(raw storage bytes instead of ``torch.save`` per storage), but it also carries ``__main__`` definitions by
value, with a copy of the sender's globals: the same call would then run on other data than on TensorPipe.

So :func:`encode` pickles the graph with plain pickle and sets aside, by ``persistent_id``, what plain pickle
should not carry itself: tensors and storages (for speed) and functions and classes that have no loadable
name (which it cannot carry). The set-aside objects go by value with pc-pickle, next to the plain pickle's
bytes; :func:`decode` puts them back in place. Three forms:

- ``b"R"`` + a plain pickle: nothing was set aside (a small call: one pickle, no pc-pickle header);
- a pc-pickle payload of ``(plain pickle bytes, [set-aside objects])``;
- a pc-pickle payload of ``(None, obj)``: what plain pickle refuses elsewhere in the graph (an object that
  only dill knows how to pickle), all by value.

A pc-pickle payload starts with pickle's protocol byte (``0x80``), never with ``b"R"``.
"""

from __future__ import annotations

import io
import pickle
import sys
import types
from typing import Any

import torch

import pc_pickle

__all__ = ["decode", "encode"]

_PLAIN = b"R"
_STORAGES: tuple[type, ...] = (torch.UntypedStorage, torch.TypedStorage)


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


class _SetAsidePickler(pickle.Pickler):
    """Plain pickle that sets aside tensors, storages and nameless functions and classes (see the module)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=5)
        self.aside: list[Any] = []
        self._index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> int | None:
        if isinstance(obj, (torch.Tensor, *_STORAGES)) or (
            isinstance(obj, (types.FunctionType, type)) and not _loads_by_name(obj)
        ):
            index = self._index.get(id(obj))
            if index is None:
                index = self._index[id(obj)] = len(self.aside)
                self.aside.append(obj)
            return index
        return None


class _PutBackUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, aside: list[Any]) -> None:
        super().__init__(file)
        self._aside = aside

    def persistent_load(self, pid: Any) -> Any:
        return self._aside[pid]


def encode(obj: Any, what: str) -> bytes:
    """The bytes of ``obj`` (see the module for the forms).

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
        whole: tuple[Any, Any] = (None, obj)
    else:
        if not pickler.aside:
            return buffer.getvalue()
        whole = (buffer.getbuffer()[len(_PLAIN) :].tobytes(), pickler.aside)
    try:
        return pc_pickle.dumps(whole)
    except pc_pickle.UnpicklableObjectError as exc:
        raise TypeError(f"{what} cannot be pickled: {exc}") from exc


def decode(data: memoryview) -> Any:
    """The object :func:`encode` wrote into ``data``."""
    if data[: len(_PLAIN)] == _PLAIN:
        return _PutBackUnpickler(io.BytesIO(data[len(_PLAIN) :]), []).load()
    plain, rest = pc_pickle.loads(data)
    if plain is None:
        return rest
    return _PutBackUnpickler(io.BytesIO(plain), rest).load()
