"""The store layer: everything pc_distributed does with a torch ``Store``, under the World and the groups.

The World's rendezvous store carries the start-up, the RPC groups' directory, the barriers and the group
joins. Its modules, one concept each:

- ``_torch_store``: the layer's torch-facing module: open, serve and scope stores (``TCPStore`` on a socket
  bound to one address, prefix views, extra client connections).
- ``_bounded_store``: :class:`BoundedStore`, a client whose every request raises ``TimeoutError`` instead of
  blocking past a deadline (the World's shared client).
- ``_waits``: :class:`WaitStores`, a connection of its own for every blocking wait, so that a waiting thread
  never stalls the others' short requests.
- ``_client``: the protocols the layer's users hold (:class:`StoreClient`, :class:`Waiter`).
- ``_keys``: atomic claims and look-ups (:func:`claim`, :func:`lookup`, :func:`release`).
- ``_barrier``: timed waits for keys (:func:`wait_keys`) and the repeatable :class:`StoreBarrier`.
- ``_etcd``: :class:`EtcdStore`, a torch ``Store`` kept in an etcd cluster (public as
  ``pc_distributed.EtcdStore``): the store of an elastic job that survives the loss of its host.

The layer imports nothing of pc_distributed but the bottom-layer helpers (``_bounded``,
``_torch_errors``); the modules inside it import each other directly, never through this package.
"""

from pc_distributed._store._barrier import StoreBarrier, arrival_key, wait_keys
from pc_distributed._store._bounded_store import BoundedStore
from pc_distributed._store._client import StoreClient, Waiter
from pc_distributed._store._etcd import EtcdStore
from pc_distributed._store._keys import claim, lookup, release
from pc_distributed._store._torch_store import (
    Store,
    listen_socket,
    master_store,
    open_store,
    prefix_store,
    serve_store,
    store_client,
    store_port,
    tcp_store_client,
)
from pc_distributed._store._waits import StoreClosedError, WaitStores

__all__ = [
    "BoundedStore",
    "EtcdStore",
    "Store",
    "StoreBarrier",
    "StoreClient",
    "StoreClosedError",
    "WaitStores",
    "Waiter",
    "arrival_key",
    "claim",
    "listen_socket",
    "lookup",
    "master_store",
    "open_store",
    "prefix_store",
    "release",
    "serve_store",
    "store_client",
    "store_port",
    "tcp_store_client",
    "wait_keys",
]
