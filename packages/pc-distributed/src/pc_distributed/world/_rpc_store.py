"""Hand torch.distributed.rpc a store object of our choosing (a prefixed view of the World's store).

torch's RPC opens its rendezvous store from an init-method URL. Through a rendezvous handler registered with
torch's public ``register_rendezvous_handler`` (on first use, so importing pc_distributed changes no torch
state), a URL of the ``pcworldstore://`` scheme hands RPC the store given to :func:`rpc_url_for_store`, once.

The hand-over table is module-level because torch's table of rendezvous handlers is: the handler is
registered once per process and finds the store by the URL's token. It is no registry of Worlds: an entry
lives only from the World's start until RPC's rendezvous takes it (the World is not installed yet then, so
the handler could not ask it), and a World never reads it again.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl, urlparse

from torch.distributed.rendezvous import register_rendezvous_handler

__all__ = ["rpc_url_for_store"]

_SCHEME = "pcworldstore"
_HANDED: dict[str, Any] = {}
_LOCK = threading.Lock()
_registered = False


def _handed_store(url: str, **_kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    parsed = urlparse(url)
    query = dict(parse_qsl(parsed.query))
    with _LOCK:
        store = _HANDED.pop(parsed.netloc, None)
    if store is None:
        raise RuntimeError(f"no store handed over under {url!r} (each is used once)")
    yield store, int(query["rank"]), int(query["world_size"])
    raise RuntimeError("a World's RPC store cannot re-rendezvous")


def rpc_url_for_store(store: Any) -> str:
    """An init method for RPC that hands it ``store`` itself, once."""
    global _registered
    with _LOCK:
        if not _registered:
            register_rendezvous_handler(_SCHEME, _handed_store)  # type: ignore[no-untyped-call]
            _registered = True
        token = uuid.uuid4().hex
        _HANDED[token] = store
    return f"{_SCHEME}://{token}"
