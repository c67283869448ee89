"""The gradient server: clients push gradients to secondary reducers, the primary steps the managed model.

Public here (and re-exported by :mod:`pc_server`): the server (:class:`PushPullGradServerImpl`), its client
accessor (:class:`PushPullGradServer`), its settings (:class:`GradServerConfig`), its counters
(:class:`GradServerStats`) and ledger (:class:`GradLedger`, :class:`PushCounts`), and the compatibility
names ``REDUCE_MASTER``/``REDUCE_SLAVE``. The modules with a leading underscore are the server's insides: the
wire protocol, the two reducer roles and what they share, the batch queue, the reductions and the checkpoint.
"""

from pc_server.grad._protocol import REDUCE_MASTER, REDUCE_SLAVE
from pc_server.grad.client import PushPullGradServer
from pc_server.grad.config import GradServerConfig
from pc_server.grad.ledger import GradLedger, PushCounts
from pc_server.grad.server import PushPullGradServerImpl
from pc_server.grad.stats import GradServerStats

__all__ = [
    "REDUCE_MASTER",
    "REDUCE_SLAVE",
    "GradLedger",
    "GradServerConfig",
    "GradServerStats",
    "PushCounts",
    "PushPullGradServer",
    "PushPullGradServerImpl",
]
