"""The dill path: functions and classes that cannot be pickled by reference.

The C pickler handles everything importable. A function or class goes to dill only when a reference would not
load back to the same object: a ``<lambda>`` or ``<locals>`` in its ``__qualname__``, a definition in
``__main__``, or a ``module.qualname`` lookup that returns something else. dill's pickler is the pure-Python
one (about 20x slower than C on plain data), so it sees only these objects, each pickled into its own nested
payload that loads with :func:`_rebuild_dill`.

The nested dill pickler shares the dump's :class:`~pc_pickle._tensors.StorageTable` (tensors inside a closure
are copied or shared like all others, and alias the rest of the graph). A module it meets (a global of a
function carried with its globals) travels as its name whenever the loader can import it by that name
(:func:`imported_by_name`), wherever its file lies, or when it was marked static; only the main script and
modules made at run time are left to dill. It uses a private copy of dill's dispatch table, so nothing is
registered in dill globally.

Non-goal: object identity across the boundary. An object reached both from a closure and from the rest of the
graph loads as two copies (tensors excepted: they share one storage).
"""

from __future__ import annotations

import importlib
import io
import sys
import threading
import types
import weakref
from typing import Any

import dill
import torch

from pc_pickle._resources import is_resource, reduce_resource
from pc_pickle._static import is_static_module
from pc_pickle._tensors import Reduced, StorageTable

__all__ = ["DILL_ONLY_TYPES", "imported_by_name", "needs_by_value", "reduce_by_value"]

_MISSING = object()

# Types the C pickler refuses but dill pickles ("everything dill can pickle, pc_pickle pickles"). Only
# instances of exactly these types take the slow path; everything else stays in C.
_CANDIDATES: tuple[Any, ...] = (
    type(threading.Lock()),
    type(threading.RLock()),
    types.CellType,
    types.CodeType,
    types.MappingProxyType,
    staticmethod,
    classmethod,
    property,
    super,
    weakref.ReferenceType,
    weakref.ProxyType,
    weakref.CallableProxyType,
    type({}.keys()),
    type({}.values()),
    type({}.items()),
)  # file handles are not here: pc_pickle._resources decides what becomes of them
DILL_ONLY_TYPES: frozenset[type] = frozenset(cls for cls in _CANDIDATES if cls in dill.Pickler.dispatch)


_MAIN_SCRIPT = frozenset(("__main__", "__mp_main__"))  # the module names of the script a process runs


def needs_by_value(obj: Any) -> bool:
    """Whether a function or class must be pickled by value (a by-name reference would not load it back).

    Args:
        obj: A function or a class.

    Returns:
        True for lambdas, local and ``__main__`` definitions, and objects not found under their own name. A
        top-level definition of a spawned process's script (``__mp_main__``) is found by name: the processes
        spawned from one script import it under that name, and the parent has it as an alias of ``__main__``.
    """
    module_name = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module_name, str) or not isinstance(qualname, str):
        return True
    if module_name == "__main__" or "<" in qualname:
        return True
    target: Any = sys.modules.get(module_name, _MISSING)
    if target is _MISSING:
        return True
    for part in qualname.split("."):
        target = getattr(target, part, _MISSING)
        if target is _MISSING:
            return True
    return target is not obj


def imported_by_name(module: types.ModuleType) -> bool:
    """Whether ``module`` is pickled by reference: an imported module that a loader can import by its name.

    That is a module the import system found (it has a ``__spec__``), registered in ``sys.modules`` under its
    own ``__name__``, and not the main script (``__main__``, ``__mp_main__``): an installed package, and
    equally one installed editable or found on ``PYTHONPATH`` or ``sys.path`` (a source checkout). dill's own
    rule pickles every module whose file lies outside ``sys.prefix`` and ``site-packages`` by value, with a
    copy of its ``__dict__``: that drags process-local state along (which then refuses to pickle) and, on
    load, overwrites the loader's own module's globals with the sender's. The main script and modules made at
    run time (``types.ModuleType(...)``, which have no spec) are left to dill.

    Args:
        module: A module object.

    Returns:
        True if ``module`` travels as its name and is imported by the loading process.
    """
    name = getattr(module, "__name__", None)
    return (
        isinstance(name, str)
        and name not in _MAIN_SCRIPT
        and getattr(module, "__spec__", None) is not None
        and sys.modules.get(name) is module
    )


class _DillPickler(dill.Pickler):  # type: ignore[misc]  # dill ships no type information
    """dill's pickler with the dump's tensor table, modules by name, and the static-module registry.

    ``reducer_override`` runs before dill's dispatch in the pure-Python pickler, so tensors, storages,
    importable and static modules never reach dill's own handlers.
    """

    # A private copy (same MetaCatchingDict type, so metaclasses still dispatch): registrations stay local.
    dispatch = type(dill.Pickler.dispatch)(dill.Pickler.dispatch)

    def __init__(self, file: io.BytesIO, table: StorageTable, recurse: bool, read_files: bool) -> None:
        super().__init__(file, protocol=5, recurse=recurse, byref=False)
        self._table = table
        self._read_files = read_files

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is torch.Tensor or cls is torch.nn.Parameter:
            return self._table.reduce_tensor(obj)
        if cls is torch.UntypedStorage:
            return self._table.reduce_untyped_storage(obj)
        if cls is types.ModuleType and (is_static_module(obj.__name__) or imported_by_name(obj)):
            return (importlib.import_module, (obj.__name__,))
        if isinstance(obj, torch.TypedStorage):
            return self._table.reduce_typed_storage(obj)
        if is_resource(cls):  # before dill's own file handlers, which reopen files with their saved mode
            return reduce_resource(obj, self._read_files)
        return NotImplemented


def reduce_by_value(obj: Any, table: StorageTable, recurse: bool, read_files: bool = False) -> Reduced:
    """Pickle a function or class by value (or a dill-only object) with dill into a nested payload.

    Args:
        obj: The function, class, or instance of one of :data:`DILL_ONLY_TYPES`.
        table: The dump's storage table (shared with the C graph pickler).
        recurse: dill's ``recurse``: carry the globals the function references by value (True) or look them up
            at load time in the function's module in the loading process (False). Functions and classes
            defined in ``__main__`` always carry them by value.
        read_files: Carry read-only file handles met inside the object (see :mod:`pc_pickle._resources`).

    Returns:
        A reduce tuple that loads the object with :func:`_rebuild_dill`.
    """
    # Code defined in the main script always carries the globals it references by value, as cloudpickle
    # does: the loader's __main__ is another script (a spawned worker re-runs the file without its `if
    # __name__ == "__main__":` block), so a by-name lookup there fails with NameError (dill#126). In a process
    # started with spawn the script is __mp_main__ (also __main__ in sys.modules, which dill takes for the
    # main module and, without recurse, pickles whole, every global of the script with it).
    by_value_globals = recurse or getattr(obj, "__module__", None) in _MAIN_SCRIPT
    buffer = io.BytesIO()
    _DillPickler(buffer, table, by_value_globals, read_files).dump(obj)
    return (_rebuild_dill, (buffer.getvalue(),))


def _rebuild_dill(data: bytes) -> Any:
    return dill.loads(data)
