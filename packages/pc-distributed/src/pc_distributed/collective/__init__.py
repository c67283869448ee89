"""Collective groups: torch.distributed's collectives on one process group, with global ranks and timeouts.

Public: :class:`CollectiveGroup` and :class:`RecvHandle` (``group.py``). The underscored modules hold the
four ``*_multigpu`` collectives as functions of a process group (``_multigpu``) and the async handles
(``_work``).
"""

from pc_distributed.collective.group import CollectiveGroup, RecvHandle

__all__ = ["CollectiveGroup", "RecvHandle"]
