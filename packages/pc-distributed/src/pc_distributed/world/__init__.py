"""The World (this process's membership, its store, process group and RPC) and the local launcher.

Public: :class:`World` and its accessors (``world.py``) and :func:`run_world` (``launcher.py``). The
underscored modules are the World's parts: the bounded start (``_rendezvous``), the store handed to RPC
(``_rpc_store``), the environment (``_env``) and the network interface variables (``_interfaces``).
"""

from pc_distributed.world.launcher import run_world
from pc_distributed.world.world import World, get_cur_name, get_cur_rank, get_world, is_world_initialized

__all__ = ["World", "get_cur_name", "get_cur_rank", "get_world", "is_world_initialized", "run_world"]
