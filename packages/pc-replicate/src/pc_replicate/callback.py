"""The replication-callback protocol: ``__data_parallel_replicate__(ctx, copy_id)``.

After a data-parallel wrapper replicates its module onto ``n`` devices, every module of every replica that
defines ``__data_parallel_replicate__`` is called with

- ``ctx``: a :class:`CallbackContext` shared by the ``n`` copies of that module position (and only by them),
  fresh for every replication, so the copies can exchange objects (e.g. copy 0 stores a master that the others
  register with);
- ``copy_id``: the index of the replica, ``0`` .. ``n - 1``.

Every callback of copy 0 finishes before any callback of another copy runs, and all callbacks run in the
caller's thread before any replica's forward starts. Example::

    class Counter(torch.nn.Module):
        def __data_parallel_replicate__(self, ctx: CallbackContext, copy_id: int) -> None:
            if copy_id == 0:
                ctx.shared = []  # copy 0 runs first
            ctx.shared.append(copy_id)
            self.peers = ctx.shared

A second, optional hook ``__data_parallel_abort__(exc)`` is called on every replica module when one replica
raises (see :mod:`pc_replicate.data_parallel`); pc-sync uses it to release replicas waiting on a
synchronisation.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import nn

__all__ = ["CallbackContext", "exec_data_parallel_replication_callback"]

logger = logging.getLogger(__name__)


class CallbackContext:
    """An empty namespace shared by the copies of one module position within one replication.

    Callbacks store whatever they need on it as attributes. A new context is created for every position on
    every replication, so nothing carries over from one forward to the next.
    """


def exec_data_parallel_replication_callback(modules: Sequence[nn.Module]) -> None:
    """Run ``__data_parallel_replicate__(ctx, copy_id)`` on each module of each replica, copy 0 first.

    ``modules[j]`` is the replica for copy ``j``. Module positions are the order of ``modules[0].modules()``
    (each shared submodule counted once); every replica must enumerate the same number and types of modules.
    The loop runs over copies on the outside and positions on the inside, so every callback of copy 0 has
    returned before any callback of copy 1 starts.

    Args:
        modules: the replicas, in copy order.

    Raises:
        TypeError: if ``modules`` is not a sequence of ``torch.nn.Module``.
        RuntimeError: if the replicas do not have the same structure.

    Example::

        replicas = dp.replicate(dp.module, dp.device_ids)  # already runs the callbacks
        exec_data_parallel_replication_callback([copy0, copy1])  # for replicas built by hand
    """
    if isinstance(modules, nn.Module) or not isinstance(modules, Sequence):
        raise TypeError(
            f"modules must be a sequence of torch.nn.Module replicas, got {type(modules).__name__}"
        )
    if not modules:
        return
    per_copy: list[list[nn.Module]] = []
    for copy_id, replica in enumerate(modules):
        if not isinstance(replica, nn.Module):
            raise TypeError(f"modules[{copy_id}] must be a torch.nn.Module, got {type(replica).__name__}")
        per_copy.append(list(replica.modules()))
    reference = per_copy[0]
    reference_types = [type(m) for m in reference]
    for copy_id, replica_modules in enumerate(per_copy[1:], start=1):
        if [type(m) for m in replica_modules] != reference_types:
            raise RuntimeError(
                f"replica {copy_id} has {len(replica_modules)} modules that do not match the "
                f"{len(reference)} modules of replica 0 in number or type; all replicas must be copies of "
                "one module"
            )
    contexts = [CallbackContext() for _ in reference]
    for copy_id, replica_modules in enumerate(per_copy):
        for ctx, module in zip(contexts, replica_modules, strict=True):
            callback = getattr(module, "__data_parallel_replicate__", None)
            if callable(callback):
                callback(ctx, copy_id)
    logger.debug("ran replication callbacks on %d copies of %d modules", len(per_copy), len(reference))
