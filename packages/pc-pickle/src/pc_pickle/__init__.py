"""Dill-compatible pickling of lambdas, modules and tensors, copied or shared (shared memory, CUDA IPC).

Public API: :class:`Pickler`, :func:`dumps`, :func:`loads`, :func:`release`, :func:`mark_static_module`,
the rules that decide what travels by value (:func:`needs_by_value`, :func:`imported_by_name`) and the
errors :class:`UnpicklableObjectError` (a :class:`pickle.PicklingError`), :class:`PayloadError` (a
:class:`pickle.UnpicklingError`) and :class:`SharedHandleError` (a :class:`PayloadError`).

Scope: short-lived transport between processes that run the same Python, torch and pc-pickle versions. Not for
long-term storage (use ``torch.save``) and not for untrusted input (loading runs code).
"""

from pc_pickle.__about__ import __version__
from pc_pickle._errors import PayloadError, SharedHandleError, UnpicklableObjectError
from pc_pickle._functions import imported_by_name, needs_by_value
from pc_pickle._pickler import Pickler, dumps, loads, release
from pc_pickle._static import mark_static_module

__all__ = [
    "PayloadError",
    "Pickler",
    "SharedHandleError",
    "UnpicklableObjectError",
    "__version__",
    "dumps",
    "imported_by_name",
    "loads",
    "mark_static_module",
    "needs_by_value",
    "release",
]
