"""The one place where pc_pool touches pc_pickle (serialization of tasks, results and queue items).

Everything that crosses a process boundary goes through :func:`dumps` and :func:`loads` here, so a change in
pc_pickle's API touches this file only. ``copy_tensor`` selects copy (tensors travel as bytes) or share
(shared memory / CUDA IPC handles, one-shot: load each payload exactly once, while the producer is alive).
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Iterable
from typing import Any

import torch

import pc_pickle

__all__ = ["collect_cuda_ipc", "dumps", "loads", "release", "release_all"]

# Plain data (scalars in lists, tuples and dicts, as most chunks of arguments and results are) takes the C
# pickle directly: pc_pickle's per-payload setup costs far more, which would dominate tiny tasks. A
# one-byte marker tells loads() which decoder to use (pc_pickle payloads start with the PROTO opcode).
_log = logging.getLogger(__name__)
_PLAIN = b"\x00"
_SCALARS = frozenset({int, float, str, bytes, bool, type(None), complex})
_MAX_DEPTH = 3


def _is_plain(obj: Any, depth: int = 0) -> bool:
    t = type(obj)
    if t in _SCALARS:
        return True
    if depth >= _MAX_DEPTH:
        return False
    if t is list or t is tuple:
        return all(type(item) in _SCALARS or _is_plain(item, depth + 1) for item in obj)
    if t is dict:
        for key, value in obj.items():
            if type(key) not in _SCALARS or (type(value) not in _SCALARS and not _is_plain(value, depth + 1)):
                return False
        return True
    return False


def dumps(obj: Any, *, recurse: bool = False, copy_tensor: bool = True) -> bytes:
    """Serialize ``obj`` with pc_pickle.

    Args:
        obj: Anything pc_pickle can pickle (lambdas, closures and tensors included).
        recurse: Carry the globals referenced by functions pickled by value.
        copy_tensor: ``True`` copies tensors into the payload; ``False`` shares them.

    Returns:
        The payload.

    Raises:
        pickle.PicklingError: ``obj`` cannot be pickled; the message names the path to the culprit.
    """
    if _is_plain(obj):
        return _PLAIN + pickle.dumps(obj, protocol=5)
    try:
        return pc_pickle.dumps(obj, recurse=recurse, copy_tensor=copy_tensor)
    except pickle.PicklingError:
        raise
    except RecursionError as exc:
        raise pickle.PicklingError(f"cannot pickle {type(obj).__name__}: recursion too deep") from exc
    except Exception as exc:
        # pc_pickle documents PicklingError; anything else (TypeError from a reducer, ...) is normalised so
        # callers have one error type to handle.
        raise pickle.PicklingError(
            f"cannot pickle {type(obj).__name__}: {type(exc).__name__}: {exc}"
        ) from exc


def loads(data: bytes, *, opened_cuda: list[torch.UntypedStorage] | None = None) -> Any:
    """Deserialize a payload produced by :func:`dumps` (in this process or another one).

    Args:
        data: The payload.
        opened_cuda: If given, receives the CUDA storages the load opened from share handles, which a holder
            may keep so that a later load of the same storage reuses the handle (see :func:`pc_pickle.loads`).

    Returns:
        The object.
    """
    if data[:1] == _PLAIN:
        return pickle.loads(memoryview(data)[1:])
    return pc_pickle.loads(data, opened_cuda=opened_cuda)


def release(data: bytes | None) -> None:
    """Give back what a share payload that will never be loaded holds (best effort, never raises).

    A payload that is not loaded keeps a ``/dev/shm`` segment reference ('file_system') or a dup'd fd in its
    producer ('file_descriptor') until that process ends; see :func:`pc_pickle.release`. Plain and copy
    payloads hold nothing.
    """
    if data is None or data[:1] == _PLAIN:
        return
    try:
        pc_pickle.release(data)
    except Exception:  # the producer is gone (its fds went with it), or it was loaded after all
        _log.debug("pc_pool: releasing an unloaded payload failed", exc_info=True)


def release_all(payload_groups: Iterable[tuple[bytes | None, ...]]) -> None:
    """:func:`release` every payload of every group (a chunk's function and arguments) nobody will load.

    Used when chunks are dropped or re-dispatched after their share payloads were made: for a worker that died
    with chunks in its pipe, and for chunks a feeder dumped but could not send.
    """
    for payloads in payload_groups:
        for payload in payloads:
            release(payload)


def collect_cuda_ipc() -> None:
    """Free what CUDA IPC still keeps for the tensors this process shared, once their receivers let go.

    torch frees a shared CUDA block, and the ``/dev/shm`` file that counts its users, only when it collects,
    which it does when it shares more; after a pool's workers have exited nothing else would, and the file
    outlives the pool. A no-op in a process that has not initialised CUDA.
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        collect: Any = torch.cuda.ipc_collect  # Any: untyped on some torch releases
        collect()
