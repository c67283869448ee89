"""Ordered key-value, model and gradient parameter servers over pc-distributed RpcGroups."""

from pc_server.__about__ import __version__
from pc_server.errors import ReducerStoppedError, ReducerTraceback
from pc_server.factory import ServerTuple, grad_server_helper, model_server_helper
from pc_server.grad import (
    REDUCE_MASTER,
    REDUCE_SLAVE,
    GradLedger,
    GradServerConfig,
    GradServerStats,
    PushCounts,
    PushPullGradServer,
    PushPullGradServerImpl,
)
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
