"""RPC groups: named members that call each other, with a single-owner directory of values and services.

Public: :class:`RpcGroup` (``group.py``) and :class:`RemoteRef` (``remote_ref.py``). The underscored modules
are the group's parts: what runs on the owner's side (``_remote``), the directory in the store
(``_directory``), the members' handshake (``_join``) and the send with its owner-retry rule (``_calls``).
"""

from pc_distributed.rpc.group import RpcGroup
from pc_distributed.rpc.remote_ref import RemoteRef

__all__ = ["RemoteRef", "RpcGroup"]
