"""Function payloads reused from job to job while nothing that went into them has changed.

A pool dumps the function of every job it sends. pc_pickle pickles a lambda, a local function or a function
of the main script *by value*, through dill's pure-Python pickler (which also disassembles the code to find
the globals it carries): 0.1 to 0.7 ms per dump, against about 10 us for a function pickled by name, paid
again by every ``apply`` of the same function. :class:`FunctionPayloads` keeps the payload of a function and
hands it out again as long as a *snapshot* of everything the payload was made from is unchanged.

What the by-value payload of a function holds (pc_pickle through dill):

* its code, name, qualname, module, doc, defaults, keyword defaults, annotations, ``__dict__`` and the
  contents of its closure cells;
* when its globals travel by value (code of the main script, or a pool with ``is_recursive=True``), the
  value of every global its code names, looked up in its globals and the builtins; dill also follows each
  function it finds there or in a closure cell, to collect the names *that* function uses (looked up in the
  same places); otherwise a reference to its module's namespace;
* the functions, classes and modules met on the way: by name when they import by name, else by value.

The snapshot lists these objects in the order the walk meets them, and two snapshots are equal when they hold
the same objects (``is``). A snapshot exists only when every object that travels by value is *frozen*:
numbers, strings, bytes, code, ``torch.dtype``/``torch.device``, tuples and frozensets of frozen objects,
type hints of frozen objects, functions (whose own state is in the snapshot), and objects that travel by name
(modules, classes, builtins and functions that import by name). Each step of the walk depends only on
objects already in the snapshot (or ends it), so an unchanged snapshot means an unchanged payload. Anything
else (a list, a dict, a tensor, an instance, a bound method) can change in place without a trace: a function
that carries one has no snapshot and is dumped per job, as it always was. A cached payload thus never holds
a tensor, and no share handle (one-shot) is ever sent twice.

The walk looks at a superset of what dill carries: every name of a code object (dill keeps those a
``*_GLOBAL`` instruction uses), looked up in every namespace it could be taken from, and by value whatever
might go by value. Looking too wide only means caching less.
"""

from __future__ import annotations

import builtins
import collections
import itertools
import operator
import sys
import threading
import types
import typing
from collections.abc import Callable
from typing import Any

import torch

import pc_pickle

__all__ = ["FunctionPayloads", "Snapshot", "same", "snapshot"]

Snapshot = list[object]
"""The objects a function's payload is made from, in walk order (compared by identity)."""

_MAIN_SCRIPT = frozenset(("__main__", "__mp_main__"))  # module names of the script a process runs
_BUILTINS: dict[str, Any] = vars(builtins)
_ATOMS = frozenset(
    {
        int,
        float,
        complex,
        str,
        bytes,
        bool,
        range,
        types.CodeType,  # immutable, and its constants are too
        type(None),
        type(Ellipsis),
        type(NotImplemented),
        torch.dtype,
        torch.device,
    }
)
_SINGLETON_TYPES = frozenset({type(None), type(Ellipsis), type(NotImplemented)})  # dill: by name
_DESCRIPTORS = frozenset(
    {types.MethodDescriptorType, types.WrapperDescriptorType, types.ClassMethodDescriptorType}
)
_TYPE_PARAMS = sys.version_info >= (3, 12)  # functions have __type_params__ (PEP 695)
_MAX_FUNCTIONS = 256  # a function that reaches more (through globals) is dumped per job: the walk stays cheap


class _Missing:
    """A name that no namespace holds, and an empty closure cell (markers in a snapshot)."""


_MISSING = _Missing()
_EMPTY_CELL = _Missing()
_END = _Missing()  # closes the items of a mapping, so mappings of other sizes never line up


def _by_value(obj: Any) -> bool:
    """Whether the function or class ``obj`` may be pickled by value: it is not found by its name.

    pc_pickle's rule, made strict enough to cover dill's too (dill finds a submodule as an attribute of its
    package): where the two could disagree, by value, whose snapshot holds more.
    """
    if pc_pickle.needs_by_value(obj):
        return True
    package, _, last = obj.__module__.rpartition(".")
    return bool(package) and getattr(sys.modules.get(package), last, None) is not sys.modules[obj.__module__]


def _module_of(fn: types.FunctionType) -> types.ModuleType | None:
    """The imported module whose namespace ``fn.__globals__`` is, found by ``fn.__module__`` as dill does."""
    name: Any = fn.__module__  # a str, unless someone assigned something else
    if not isinstance(name, str):
        return None
    if "." in name:
        parent, _, last = name.rpartition(".")
        module = getattr(sys.modules.get(parent), last, None)
    else:
        module = sys.modules.get(name)
    if type(module) is not types.ModuleType or module.__dict__ is not fn.__globals__:
        return None
    return module


def _among(obj: object, objects: tuple[object, ...]) -> bool:
    """Whether ``obj`` is one of ``objects`` (by identity: ``in`` would compare namespaces item by item)."""
    return any(map(operator.is_, objects, itertools.repeat(obj)))


def _names(code: types.CodeType) -> list[str]:
    """Every name ``code`` and the code nested in it use (``co_names``: globals, attributes, imports)."""
    names = list(code.co_names)
    for const in code.co_consts:
        if type(const) is types.CodeType:
            names.extend(_names(const))
    return names


class _Walk:
    """One snapshot being taken: ``out`` collects the objects; a method returns False on a non-frozen one."""

    def __init__(self, carries_globals: bool) -> None:
        self.carries_globals = carries_globals
        self.out: Snapshot = []
        self.seen: set[tuple[int, ...]] = set()

    # -- values that travel in the payload ------------------------------------------------------------------
    def value(self, v: Any, spaces: tuple[dict[str, Any], ...]) -> bool:
        """Record ``v`` (it travels in the payload) and check that it is frozen."""
        self.out.append(v)
        return type(v) in _ATOMS or self.frozen(v, spaces)  # (the common case without a call)

    def frozen(self, v: Any, spaces: tuple[dict[str, Any], ...]) -> bool:
        t = type(v)
        if t in _ATOMS:
            return True
        if t is tuple or t is frozenset:
            return all(type(item) in _ATOMS or self.frozen(item, spaces) for item in v)
        if t is types.FunctionType:
            return self.function(v, spaces, via_cell=False)
        if t is types.ModuleType:
            return pc_pickle.imported_by_name(v)
        if t is types.BuiltinFunctionType:  # by name, unless bound to an object (then that object travels)
            owner = v.__self__
            if owner is None or isinstance(owner, type):
                return owner is None or not _by_value(owner)
            return type(owner) is types.ModuleType and pc_pickle.imported_by_name(owner)
        if t in _DESCRIPTORS:  # getattr(its class, name)
            return not _by_value(v.__objclass__)
        if isinstance(v, type):
            if v in _SINGLETON_TYPES:
                return True
            # dill pickles a namedtuple class by value (fields and defaults), whatever its module
            return not _by_value(v) and not (v.__bases__ == (tuple,) and hasattr(v, "_fields"))
        if t is types.GenericAlias:  # list[int]
            return self.frozen(v.__origin__, spaces) and self.frozen(v.__args__, spaces)
        if t is types.UnionType:  # int | None
            return self.frozen(v.__args__, spaces)
        if t.__module__ == "typing":  # Optional[int], Any, Union: by name, or built from their parts
            origin = typing.get_origin(v)
            return (origin is None or self.frozen(origin, spaces)) and self.frozen(typing.get_args(v), spaces)
        return False

    def mapping(self, d: Any, spaces: tuple[dict[str, Any], ...]) -> bool:
        """Record a dict of a function (``__kwdefaults__``, ``__annotations__``, ``__dict__``) by item."""
        if d is None:
            self.out.append(None)
            return True
        if type(d) is not dict:
            return False
        if not d:
            self.out.append(_END)
            return True
        for key, item in d.items():
            if not (self.value(key, spaces) and self.value(item, spaces)):
                return False
        self.out.append(_END)
        return True

    # -- functions ------------------------------------------------------------------------------------------
    def function(
        self,
        fn: types.FunctionType,
        spaces: tuple[dict[str, Any], ...],
        via_cell: bool,
        by_value: bool | None = None,
    ) -> bool:
        """Walk a function met in the payload (by value: its state; with globals: the names it leads to).

        ``spaces`` are the namespaces whose values for ``fn``'s names travel in the payload (with globals by
        value): the top function's globals, those of each function pickled by value on the way, and those of
        functions in closure cells (dill merges what it finds for them into the enclosing lookup).
        ``by_value`` is ``_by_value(fn)`` when the caller knows it.
        """
        out = self.out
        out.append(fn)
        key = (id(fn), *map(id, spaces))
        if key in self.seen:
            return True
        self.seen.add(key)
        if len(self.seen) > _MAX_FUNCTIONS:
            return False
        if by_value is None:
            by_value = _by_value(fn)
        code = fn.__code__
        out.append(by_value)
        out.append(code)
        own = fn.__globals__
        if self.carries_globals and (by_value or via_cell) and not _among(own, spaces):
            spaces = (*spaces, own)
        if by_value and not self.state(fn, spaces):
            return False
        if fn.__closure__ is not None and not self.cells(fn, spaces, by_value):
            return False
        if not self.carries_globals:
            if not by_value:
                return True
            # dill refers to fn's globals by name when they are the namespace of the module fn names, which it
            # can import; otherwise it pickles the whole namespace by value, which is never frozen.
            module = _module_of(fn)
            out.append(module)
            return module is not None
        follow_own = not _among(own, spaces)
        for name in _names(code):
            for space in spaces:  # values that travel: frozen, and followed
                found = space.get(name, _MISSING)
                if found is _MISSING:
                    found = _BUILTINS.get(name, _MISSING)
                if found is _MISSING:
                    out.append(found)
                elif not self.value(found, spaces):
                    return False
            if follow_own:  # fn travels by name: only the names its own globals lead to matter
                found = own.get(name, _BUILTINS.get(name, _MISSING))
                out.append(found)
                if not self.follow(found, spaces, via_cell=False):
                    return False
        return True

    def state(self, fn: types.FunctionType, spaces: tuple[dict[str, Any], ...]) -> bool:
        """Record what dill pickles of a by-value function besides its code, closure and globals."""
        for attr in (fn.__name__, fn.__qualname__, fn.__module__, fn.__doc__, fn.__defaults__):
            if not self.value(attr, spaces):
                return False
        if _TYPE_PARAMS and not self.value(getattr(fn, "__type_params__", ()), spaces):
            return False
        return (
            self.mapping(fn.__kwdefaults__, spaces)
            and self.mapping(fn.__annotations__, spaces)
            and self.mapping(fn.__dict__, spaces)
        )

    def cells(self, fn: types.FunctionType, spaces: tuple[dict[str, Any], ...], by_value: bool) -> bool:
        """Record the contents of ``fn``'s closure cells (they travel with a by-value function)."""
        for cell in fn.__closure__ or ():
            try:
                content = cell.cell_contents
            except ValueError:
                self.out.append(_EMPTY_CELL)
                continue
            if type(content) is types.FunctionType:
                self.out.append(content)
                ok = self.function(content, spaces, via_cell=True)
            elif by_value:
                ok = self.value(content, spaces)
            else:
                self.out.append(content)
                ok = self.follow(content, spaces, via_cell=True)
            if not ok:
                return False
        return True

    def follow(self, found: Any, spaces: tuple[dict[str, Any], ...], via_cell: bool) -> bool:
        """An object that does not travel but that dill follows, if it is a function, for more names."""
        if type(found) is types.MethodType:
            found = found.__func__
        if type(found) is types.FunctionType:
            return self.function(found, spaces, via_cell=via_cell)
        return True


def snapshot(func: object, recurse: bool) -> Snapshot | None:
    """The snapshot of ``func``'s payload, or ``None`` if a change to it could go unnoticed.

    Args:
        func: The function of a job.
        recurse: The pool's ``is_recursive``: the globals of every function pickled by value travel by value
            (they always do for functions of the main script).

    Returns:
        The objects the payload is made from (compare with :func:`same`), or ``None`` for anything but a plain
        function, and for a function that carries an object that can change in place.
    """
    if type(func) is not types.FunctionType:
        return None
    try:
        if not _by_value(func):
            return [func, False]  # pickled by name: the payload is its name
        walk = _Walk(carries_globals=recurse or func.__module__ in _MAIN_SCRIPT)
        return walk.out if walk.function(func, (), via_cell=False, by_value=True) else None
    except Exception:  # RecursionError, an attribute that raises (lazy annotations): not cached
        return None


def same(a: Snapshot, b: Snapshot) -> bool:
    """Whether two snapshots hold the same objects, in the same order."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


class FunctionPayloads:
    """The payloads of the last ``size`` functions a pool dumped, each reused while its snapshot is unchanged.

    Thread-safe: feeders and caller threads dump concurrently. An entry keeps its function alive (so its id is
    not reused) until ``size`` newer functions push it out.

    Args:
        dump: Makes a function's payload (copying tensors: a cached payload holds none, see the module notes).
        recurse: The pool's ``is_recursive``.
        size: Entries kept.
    """

    def __init__(self, dump: Callable[[object], bytes], recurse: bool, size: int = 64) -> None:
        self._dump = dump
        self._recurse = recurse
        self._size = size
        self._entries: collections.OrderedDict[int, tuple[object, Snapshot, bytes]]
        self._entries = collections.OrderedDict()
        self._lock = threading.Lock()

    def payload(self, func: object) -> bytes | None:
        """The payload of ``func``: the cached one while its snapshot is unchanged, else a new (kept) dump.

        Returns:
            The payload, or ``None`` when ``func`` has no snapshot: the caller dumps it itself, every time.

        Raises:
            pickle.PicklingError: ``func`` cannot be pickled (from ``dump``).
        """
        before = snapshot(func, self._recurse)
        if before is None:
            return None
        key = id(func)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] is func and same(entry[1], before):
                self._entries.move_to_end(key)
                return entry[2]
        blob = self._dump(func)
        after = snapshot(func, self._recurse)
        if after is not None and same(after, before):  # nothing changed while it was being dumped
            with self._lock:
                self._entries[key] = (func, before, blob)
                self._entries.move_to_end(key)
                while len(self._entries) > self._size:
                    self._entries.popitem(last=False)
        return blob
