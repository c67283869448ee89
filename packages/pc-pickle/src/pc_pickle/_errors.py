"""The errors pc_pickle raises; each subclasses the matching :mod:`pickle` error.

Callers that already catch :class:`pickle.PicklingError` or :class:`pickle.UnpicklingError` keep working; the
subclasses add what happened (the access path to an unpicklable object, a malformed payload, a shared-memory
handle that can no longer be opened).
"""

from __future__ import annotations

import pickle

__all__ = ["PayloadError", "SharedHandleError", "UnpicklableObjectError"]


class UnpicklableObjectError(pickle.PicklingError):
    """An object in the graph cannot be pickled.

    The message starts with the access path from the dumped object to the offending one (for example
    ``obj['model'].hook``), then names its type and the reason; the original exception is chained as
    ``__cause__``. Nothing was written and no tensor was moved to shared memory.

    Attributes:
        path: The access path, such as ``obj['model'].hook`` (``obj`` is the dumped object itself).
    """

    def __init__(self, message: str, path: str = "obj") -> None:
        super().__init__(message)
        self.path = path


class PayloadError(pickle.UnpicklingError):
    """The bytes given to :func:`pc_pickle.loads` are not a readable pc_pickle payload.

    Raised for foreign or truncated bytes, for a payload written by another format version (the message names
    both versions), and for tensors whose device does not exist in the loading process.
    """


class SharedHandleError(PayloadError):
    """A shared-memory or CUDA-IPC handle in a ``copy_tensor=False`` payload could not be opened.

    Usual causes: the producing process exited before the load (``file_descriptor`` sharing strategy: the file
    descriptor is fetched from the producer), or the payload was loaded a second time (share payloads are
    one-shot). The underlying error is chained as ``__cause__``.
    """
