"""Keep torch's "Failed to initialize NumPy" warning out of pc-pool's imports and spawned workers.

torch warns when it is imported without numpy; pc-pool never needs numpy. A spawned worker imports torch
(through the caller's main module, which spawn re-imports, and through pc_pool) before any pc code runs in
it, so a filter set inside the worker would come too late. The filter travels on the worker's command line
instead: ``multiprocessing`` passes the parent's ``sys.warnoptions`` to spawned children as ``-W`` options,
so the option is present in ``sys.warnoptions`` exactly while a worker starts (fork workers inherit the
parent's imports and print nothing). Only this one message of ``UserWarning`` is ignored, and only when
numpy cannot be imported.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "NUMPY_WARNING",
    "NUMPY_WARNING_OPTION",
    "import_torch_quietly",
    "numpy_missing",
    "quiet_numpy_warning_in_children",
]

NUMPY_WARNING = "Failed to initialize NumPy"
NUMPY_WARNING_OPTION = f"ignore:{NUMPY_WARNING}:UserWarning"

_lock = threading.Lock()
_starting = 0  # workers being started right now, across pools and threads
_added = False  # whether we put NUMPY_WARNING_OPTION into sys.warnoptions (and so must take it out)


@functools.cache
def numpy_missing() -> bool:
    """Whether numpy cannot be imported here (then torch warns on import); checked once per process."""
    try:
        return importlib.util.find_spec("numpy") is None
    except (ImportError, ValueError):
        return True


@contextmanager
def quiet_numpy_warning_in_children() -> Iterator[None]:
    """While inside, spawned children start with ``-W ignore:Failed to initialize NumPy:UserWarning``.

    A no-op when numpy is importable. Safe to nest and to enter from several threads: the option is added
    by the first entry and removed by the last exit, and never removed if it was there before.
    """
    global _starting, _added
    if not numpy_missing():
        yield
        return
    with _lock:
        _starting += 1
        if _starting == 1 and NUMPY_WARNING_OPTION not in sys.warnoptions:
            sys.warnoptions.append(NUMPY_WARNING_OPTION)
            _added = True
    try:
        yield
    finally:
        with _lock:
            _starting -= 1
            if _starting == 0 and _added:
                if NUMPY_WARNING_OPTION in sys.warnoptions:
                    sys.warnoptions.remove(NUMPY_WARNING_OPTION)
                _added = False


def import_torch_quietly() -> None:
    """Import torch with its numpy warning ignored (a no-op when torch is already imported)."""
    if "torch" in sys.modules:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NUMPY_WARNING, category=UserWarning)
        import torch  # noqa: F401


import_torch_quietly()  # pc_pool imports this module first, before any module that imports torch
