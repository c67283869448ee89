"""The thin layer over torch.distributed and torch.distributed.rpc that World uses to start and stop.

Every torch call that sets up or tears down global state lives here, so a change in torch touches one file.
Public torch APIs only.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, urlparse

import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.distributed.rendezvous import register_rendezvous_handler

__all__ = [
    "Store",
    "destroy_pg",
    "init_pg",
    "master_store",
    "open_store",
    "prefix_store",
    "rpc_url_for_store",
    "shutdown_rpc",
    "start_rpc",
    "store_client",
    "store_port",
]

# torch.distributed re-exports these from its C extension; its type stubs do not list them.
Store: Any = dist.Store  # type: ignore[attr-defined]
_PrefixStore: Any = dist.PrefixStore  # type: ignore[attr-defined]
_TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]
_rendezvous: Any = dist.rendezvous  # type: ignore[attr-defined]

logger = logging.getLogger(__name__)


def open_store(url: str, rank: int, world_size: int, timeout: float) -> Any:
    """Open the rendezvous store of ``url`` (rank 0 serves it unless an agent does)."""
    rendezvous = _rendezvous(url, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
    store, _, _ = next(rendezvous)
    store.set_timeout(timedelta(seconds=timeout))
    return store


def master_store(host: str, port: int, world_size: int, timeout: float) -> Any:
    """Serve a new TCPStore on ``host:port`` only (port 0: a free port; read it with ``store_port``).

    We bind the listening socket ourselves and hand it to the store (``master_listen_fd``), because TCPStore
    binds every interface when it creates the socket. The store is multi-tenant, so RPC's rendezvous on the
    same address reuses it.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.listen(128)
        bound_port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()  # the store owns the descriptor from here on (it closes it)
    try:
        return _TCPStore(
            host,
            bound_port,
            world_size,
            is_master=True,
            timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
            multi_tenant=True,
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise


def prefix_store(prefix: str, store: Any) -> Any:
    """A view of ``store`` whose keys are prefixed by ``prefix``."""
    return _PrefixStore(prefix, store)


_SCHEME = "pcworldstore"
_HANDED: dict[str, Any] = {}
_HANDED_LOCK = threading.Lock()
_registered = False


def _handed_store(url: str, **_kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    parsed = urlparse(url)
    query = dict(parse_qsl(parsed.query))
    with _HANDED_LOCK:
        store = _HANDED.pop(parsed.netloc, None)
    if store is None:
        raise RuntimeError(f"no store handed over under {url!r} (each is used once)")
    yield store, int(query["rank"]), int(query["world_size"])
    raise RuntimeError("a World's RPC store cannot re-rendezvous")


def rpc_url_for_store(store: Any) -> str:
    """An init method for RPC that hands it ``store`` itself (once): a prefixed view of the World's store.

    torch.distributed.rpc opens its store from a URL; through a rendezvous handler registered here (torch's
    public ``register_rendezvous_handler``), RPC uses the store we give it, keys scoped as we choose.
    """
    global _registered
    with _HANDED_LOCK:
        if not _registered:  # on first use: importing pc_distributed changes no torch state
            register_rendezvous_handler(_SCHEME, _handed_store)  # type: ignore[no-untyped-call]
            _registered = True
        token = uuid.uuid4().hex
        _HANDED[token] = store
    return f"{_SCHEME}://{token}"


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


def init_pg(store: Any, backend: str, rank: int, world_size: int, timeout: float) -> None:
    """Create the default process group on ``store``."""
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
    )


def destroy_pg() -> None:
    """Destroy the default process group (and every subgroup) if there is one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def start_rpc(name: str, rank: int, world_size: int, url: str, timeout: float) -> None:
    """Initialise RPC with TensorPipe on ``url``."""
    options = rpc.TensorPipeRpcBackendOptions(init_method=url, rpc_timeout=timeout)
    with warnings.catch_warnings():
        # torch's own TensorPipe start-up gathers the worker names over a Backend it builds itself and then
        # warns about that deprecated use of its own API; nothing the caller can act on.
        warnings.filterwarnings(
            "ignore", message=r"You are using a Backend .* as a ProcessGroup", category=UserWarning
        )
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)  # type: ignore[no-untyped-call]


def shutdown_rpc(graceful: bool, timeout: float) -> None:
    """Shut RPC down within ``timeout``; a failed graceful shutdown falls back to a non-graceful one.

    A graceful shutdown without a timeout hangs forever when a peer died, so there is always one.
    """
    if graceful:
        try:
            rpc.shutdown(graceful=True, timeout=timeout)
            return
        except Exception as exc:
            warnings.warn(
                f"graceful RPC shutdown failed ({type(exc).__name__}: {exc}); shutting down non-gracefully",
                RuntimeWarning,
                stacklevel=3,
            )
    try:
        rpc.shutdown(graceful=False)
    except Exception as exc:  # pragma: no cover - torch refuses a second shutdown on some versions
        logger.debug("non-graceful RPC shutdown raised %r", exc)
