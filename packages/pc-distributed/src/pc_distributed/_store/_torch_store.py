"""The store layer's torch-facing module: every call that makes, serves or scopes a torch ``Store``.

Opening the rendezvous store as a client (:func:`open_store`), serving a ``TCPStore`` on a socket bound to one
address (:func:`listen_socket`, :func:`serve_store`, :func:`master_store`), key-prefixed views
(:func:`prefix_store`) and extra client connections (:func:`store_client`, :func:`tcp_store_client`) live
here, so a change in torch's store API touches one file. Public torch APIs only; where releases differ (the
``tcp://`` handler, whether the default libuv server takes a listening descriptor) the difference is found out
here, and only here.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist

from pc_distributed._bounded import WAIT_GRACE, call_bounded

__all__ = [
    "Store",
    "StoreTimeoutError",
    "listen_socket",
    "master_store",
    "open_store",
    "prefix_store",
    "serve_store",
    "store_client",
    "store_port",
    "tcp_store_client",
]

# torch.distributed re-exports these from its C extension; its type stubs do not list them.
Store: Any = dist.Store  # type: ignore[attr-defined]
_PrefixStore: Any = dist.PrefixStore  # type: ignore[attr-defined]
_TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]
_rendezvous: Any = dist.rendezvous  # type: ignore[attr-defined]
# What torch's stores raise when a waited key stays missing (a RuntimeError subclass; plain RuntimeError
# where a build lacks it).
StoreTimeoutError: type[RuntimeError] = getattr(dist, "DistStoreError", RuntimeError)

logger = logging.getLogger(__name__)


def open_store(url: str, rank: int, world_size: int, timeout: float) -> Any:
    """Open the rendezvous store of ``url`` as a client (the store is served by rank 0 or by an agent).

    A plain ``tcp://host:port`` gets a ``TCPStore`` client made here: torch's ``tcp://`` handler differs
    between releases when an agent serves the store (torch 2.4 requires ``TORCHELASTIC_RESTART_COUNT`` and
    wraps the client in a ``/worker/attempt_N`` prefix, later releases do neither), and the World scopes its
    keys itself. Other URLs go through torch's rendezvous handlers: the World hands over only ``file://``
    ones (it turns ``env://`` and a ``tcp://`` query into a plain address first, so that rank 0 serves it
    on exactly that address and never through torch's handler, which binds every interface).
    """
    parsed = urlparse(url)
    if parsed.scheme == "tcp" and not parsed.query and parsed.hostname and parsed.port:
        # wait_for_workers (the default) makes the client count itself in at once: a request, so a server
        # that accepts and never answers is found here, inside the caller's bound, as with torch's handler.
        return _TCPStore(
            parsed.hostname, parsed.port, world_size, is_master=False, timeout=timedelta(seconds=timeout)
        )
    rendezvous = _rendezvous(url, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
    store, _, _ = next(rendezvous)
    store.set_timeout(timedelta(seconds=timeout))
    return store


def master_store(host: str, port: int, world_size: int, timeout: float) -> Any:
    """Serve a new TCPStore on ``host:port`` only (port 0: a free port; read it with ``store_port``).

    We bind the listening socket ourselves (:func:`listen_socket`) and hand it to the store
    (:func:`serve_store`), because TCPStore binds every interface when it creates the socket. The store is
    multi-tenant, so RPC's rendezvous on the same address reuses it.
    """
    fd, bound_port = listen_socket(host, port)
    return serve_store(host, bound_port, fd, world_size, timeout)


def listen_socket(host: str, port: int) -> tuple[int, int]:
    """A listening TCP socket bound to ``host:port`` only (port 0: a free one): its descriptor and port.

    Clients that connect before a store serves it wait in the listen backlog, so a launcher can start its
    processes first and serve the store after (no process is forked while the store's threads run).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.listen(128)
        bound_port = int(sock.getsockname()[1])
    except BaseException:
        sock.close()
        raise
    return sock.detach(), bound_port


def serve_store(host: str, port: int, fd: int, world_size: int, timeout: float) -> Any:
    """Serve a master TCPStore on the listening socket ``fd`` (from :func:`listen_socket`); it owns ``fd``.

    On failure the descriptor is closed.
    """
    try:
        return _serve_on_fd(host, port, world_size, timeout, fd)
    except BaseException:
        os.close(fd)
        raise


# Whether this torch's default (libuv) TCPStore server refuses a listening descriptor; None until first tried.
# No lock: two threads that find out at once find the same answer and store it twice.
_listen_fd_needs_legacy: bool | None = None


def _serve_on_fd(host: str, port: int, world_size: int, timeout: float, fd: int) -> Any:
    """A master TCPStore on the bound, listening socket ``fd``.

    Some torch releases (2.4) serve TCPStore with libuv by default and their libuv server cannot take a
    listening descriptor (``NotImplementedError``, the descriptor left open); the legacy server can. The first
    call finds out which one this torch needs and later calls go straight to it.
    """
    global _listen_fd_needs_legacy
    options: dict[str, Any] = {
        "is_master": True,
        "timeout": timedelta(seconds=timeout),
        "wait_for_workers": False,
        "multi_tenant": True,
        "master_listen_fd": fd,
    }
    if not _listen_fd_needs_legacy:
        try:
            store = _TCPStore(host, port, world_size, **options)
        except NotImplementedError:
            if _listen_fd_needs_legacy is not None:
                raise
            logger.debug("TCPStore's libuv server refuses a listening fd here; using the legacy server")
        else:
            _listen_fd_needs_legacy = False
            return store
        _listen_fd_needs_legacy = True
    return _TCPStore(host, port, world_size, use_libuv=False, **options)


def prefix_store(prefix: str, store: Any) -> Any:
    """A view of ``store`` whose keys are prefixed by ``prefix``."""
    return _PrefixStore(prefix, store)


def store_port(store: Any) -> int | None:
    """The port of a TCPStore, or None for other stores."""
    return int(store.port) if isinstance(store, _TCPStore) else None


def store_client(store: Any, timeout: float) -> Any | None:
    """A new client connection to the server of TCPStore ``store``, or None for other stores.

    A TCPStore client runs one request at a time (a blocking ``wait`` holds it until it returns), so a thread
    that blocks needs a connection of its own.
    """
    if not isinstance(store, _TCPStore):
        return None
    return _TCPStore(
        store.host, store.port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False
    )


def tcp_store_client(host: str, port: int, timeout: float) -> Any:
    """A new client of the TCPStore served at ``host:port`` (the connect itself bounded by ``timeout``).

    The connect runs on a helper thread bounded by ``timeout`` plus ``WAIT_GRACE`` (the constructor waits
    for the server's handshake with no deadline of its own).

    Raises:
        TimeoutError: If the store's server does not answer within ``timeout``.
        RuntimeError: torch's error if the connection is refused.
    """
    return call_bounded(
        lambda: _TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False
        ),
        timeout + WAIT_GRACE,
        f"the store at {host}:{port}",
    )
