"""The registry of static modules: modules pickled by name (imported on load), never by value.

A module that holds ``ctypes`` handles or other process-local state cannot be pickled by value; marking it
static makes both pickling paths (the C fast path and the dill path) write a reference to it instead. The
module object itself is never modified.
"""

from __future__ import annotations

import threading
import types

__all__ = ["is_static_module", "mark_static_module"]

_lock = threading.Lock()
# Names, not module objects: a name is what the loading process imports, and holding names keeps no module
# alive.
_static_names: set[str] = set()


def mark_static_module(module: types.ModuleType) -> None:
    """Pickle ``module`` by name from now on, never by value.

    Some modules are static: they are stateless, or their state is process-local (a ``ctypes.CDLL`` loaded by
    hand, pointers into a C library), and they are the same whether imported in process A or process B. A
    module the import system found and registered under its own name already travels by name, wherever its
    file lies; the main script and modules made at run time (no ``__spec__``) are left to dill, which pickles
    one that has a file outside ``site-packages`` by value, together with its ``__dict__``: that fails or
    produces garbage for such modules. After this call, every reference to the module (for example a global
    of a function pickled with ``recurse=True``) is written as its name and imported when loaded, so the
    module must be importable (or already in ``sys.modules``) in the loading process.

    The call is idempotent and does not modify the module (``module.__file__`` stays).

    Args:
        module: The module object to mark.

    Raises:
        TypeError: If ``module`` is not a module object.

    Examples:
        >>> import json
        >>> mark_static_module(json)
        >>> mark_static_module(json)  # harmless
    """
    if not isinstance(module, types.ModuleType):
        raise TypeError(
            f"mark_static_module expects a module object, got {type(module).__qualname__}: {module!r}"
        )
    with _lock:
        _static_names.add(module.__name__)


def is_static_module(name: str) -> bool:
    """Return whether the module called ``name`` was marked with :func:`mark_static_module`.

    Args:
        name: A module's ``__name__``.

    Returns:
        True if the module is pickled by name.
    """
    return name in _static_names
