"""The path finder: after a failed dump, find the access path to the object that cannot be pickled.

It runs only after a failure, so the fast path pays nothing for it. It re-walks the graph from the root: a
child that fails to pickle on its own is descended into; the deepest failing object whose children all pickle
is the culprit. Paths read like Python: ``obj['model'].hook``, ``obj[2].<closure>.lock``.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["find_unpicklable"]

# A failure found at this depth is reported there; very deep graphs are not walked further.
_MAX_DEPTH = 100


def _reduces_itself(cls: type) -> bool:
    """Whether ``cls`` says how it pickles (its own ``__reduce_ex__`` or ``__reduce__``): not by its dict."""
    return any("__reduce_ex__" in vars(klass) or "__reduce__" in vars(klass) for klass in cls.__mro__[:-1])


def _reduce_children(obj: Any) -> Iterator[tuple[str, Any]]:
    """What ``obj``'s reduce hands the pickler (nothing when the reduce itself fails: obj is the culprit)."""
    try:
        reduced = obj.__reduce_ex__(5)
    except Exception:
        return
    if isinstance(reduced, tuple):
        for i, arg in enumerate(reduced[1] if len(reduced) > 1 else ()):
            yield f".<reduce arg {i}>", arg
        if len(reduced) > 2 and reduced[2] is not None:
            yield ".<state>", reduced[2]


def _object_children(obj: Any) -> Iterator[tuple[str, Any]]:
    if _reduces_itself(type(obj)):
        # what it pickles is what its reduce returns, not its attributes (a reduce that refuses makes it the
        # culprit, whatever it holds)
        yield from _reduce_children(obj)
        return
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        for name, value in attrs.items():
            if isinstance(obj, torch.nn.Module) and name in ("_modules", "_parameters", "_buffers"):
                # Submodules, parameters and buffers read as attributes: `obj.encoder.weight`.
                for key, item in value.items():
                    yield f".{key}", item
            else:
                yield f".{name}", value
    for klass in type(obj).__mro__:
        for slot in getattr(klass, "__slots__", ()):
            if isinstance(slot, str) and slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                yield f".{slot}", getattr(obj, slot)
    if attrs is None and not hasattr(type(obj), "__slots__"):
        yield from _reduce_children(obj)


def _function_children(fn: types.FunctionType) -> Iterator[tuple[str, Any]]:
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
        try:
            yield f".<closure>.{name}", cell.cell_contents
        except ValueError:  # empty cell
            continue
    for name in fn.__code__.co_names:
        if name in fn.__globals__:
            yield f".<globals>.{name}", fn.__globals__[name]
    for i, default in enumerate(fn.__defaults__ or ()):
        yield f".__defaults__[{i}]", default
    for name, default in (fn.__kwdefaults__ or {}).items():
        yield f".__kwdefaults__[{name!r}]", default


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield f"[{key!r}]", value
            if not isinstance(key, (str, int, float, bytes, tuple)):
                yield f".<key {key!r}>", key
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield f"[{i}]", item
    elif isinstance(obj, (set, frozenset)):
        for item in obj:
            yield f".<item {item!r}>", item
    elif isinstance(obj, types.FunctionType):
        yield from _function_children(obj)
    elif isinstance(obj, types.MethodType):
        yield ".__self__", obj.__self__
        yield ".__func__", obj.__func__
    elif not isinstance(obj, (type, types.ModuleType, torch.Tensor)):
        yield from _object_children(obj)


def find_unpicklable(
    obj: Any, error_of: Callable[[Any], BaseException | None]
) -> tuple[str, Any, BaseException] | None:
    """Find the access path to the innermost object that does not pickle.

    Args:
        obj: The root object of the failed dump.
        error_of: Pickles one object on its own; returns the exception, or None if it pickled.

    Returns:
        ``(path, culprit, exception)``, or None if the root pickles on its own (the failure was elsewhere).
    """
    error = error_of(obj)
    if error is None:
        return None
    seen = {id(obj)}
    path, culprit = "obj", obj
    for _ in range(_MAX_DEPTH):
        if isinstance(error, RecursionError):
            break
        for suffix, child in _children(culprit):
            if id(child) in seen:
                continue
            seen.add(id(child))
            child_error = error_of(child)
            if child_error is not None:
                path, culprit, error = path + suffix, child, child_error
                break
        else:
            break
    return path, culprit, error
