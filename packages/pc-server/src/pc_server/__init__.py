"""Ordered key-value, model and gradient parameter servers over pc-distributed RpcGroups."""

from pc_server.__about__ import __version__
from pc_server.errors import ReducerStoppedError, ReducerTraceback
from pc_server.factory import ServerTuple, grad_server_helper, model_server_helper
from pc_server.grad_client import REDUCE_MASTER, REDUCE_SLAVE, PushPullGradServer
from pc_server.grad_config import GradServerConfig
from pc_server.grad_server import GradServerStats, PushPullGradServerImpl
from pc_server.ledger import GradLedger, PushCounts
from pc_server.model_server import PushPullModelServer, PushPullModelServerImpl
from pc_server.ordered_server import OrderedServerBase, OrderedServerSimple, OrderedServerSimpleImpl

__all__ = [
    "REDUCE_MASTER",
    "REDUCE_SLAVE",
    "GradLedger",
    "GradServerConfig",
    "GradServerStats",
    "OrderedServerBase",
    "OrderedServerSimple",
    "OrderedServerSimpleImpl",
    "PushCounts",
    "PushPullGradServer",
    "PushPullGradServerImpl",
    "PushPullModelServer",
    "PushPullModelServerImpl",
    "ReducerStoppedError",
    "ReducerTraceback",
    "ServerTuple",
    "__version__",
    "grad_server_helper",
    "model_server_helper",
]
