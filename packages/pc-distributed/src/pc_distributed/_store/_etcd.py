"""A torch ``Store`` kept in an etcd cluster: the store survives the loss of any minority of its hosts.

Every other store an elastic job can use (torchrun's agent store, ``run_world``'s launcher store, a
``TCPStore`` of one's own) lives in one process on one host: when that host is cut off, nobody can decide
anything, not even a majority of the members that still reach each other. etcd replicates its keys over a
cluster with Raft, so a majority of the cluster's members decides and a minority cut off from it gets no
answer. Put an etcd member on each of (an odd number of) the job's hosts and the side of a partition that
holds a majority of them goes on, while the other side's requests time out.

The client speaks etcd's v3 JSON gateway (``/v3/kv/...``, ``/v3/watch``, served on every etcd client port
since etcd 3.3) with the standard library's ``http.client``: no client library to install or keep in
step with torch. Reads are linearizable (etcd's default), so a member cut off from the cluster's majority
cannot read stale decisions. Each request opens its own connection, so the store is safe to share between
threads and a slow request never queues the others.

What maps to what: ``set`` is a put; ``get`` and ``wait`` read the key and, while it is missing, watch it
from the revision they read (no polling); ``add`` and ``compare_set`` are transactions on the key's
revision and value, so they are atomic across clients; ``delete_key`` is a delete-range of the one key.
"""

from __future__ import annotations

import base64
import http.client
import json
import threading
import time
import urllib.parse
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

from pc_distributed._store._torch_store import Store, StoreTimeoutError

__all__ = ["EtcdStore"]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _raw(value: str | bytes | Iterable[int]) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape")
    return bytes(value)


class EtcdStore(Store):  # type: ignore[misc]
    """A ``torch.distributed.Store`` whose keys live in an etcd v3 cluster.

    Any torch process group, and :class:`~pc_distributed.ElasticDataParallel`, can use it as its store.

    Args:
        endpoints: The cluster's client URLs (``"http://10.0.0.1:2379"``), one string or several; a
            request goes to the first that answers, starting with the last one that did.
        prefix: Prefix of every key in etcd (several stores and jobs can share one cluster).
        timeout: Seconds of each request, and the default of ``get`` and ``wait`` on a missing key.

    Raises:
        TypeError: If ``endpoints`` is not a string or a sequence of strings.
        ValueError: If an endpoint is not an ``http://host:port`` URL, or ``timeout`` is not positive.

    A request that no endpoint answers within ``timeout`` raises ``TimeoutError`` naming the endpoints (a
    member cut off from the cluster's majority gets this: etcd answers linearizable reads and writes only
    with a majority); ``get`` and ``wait`` on keys that stay missing raise torch's ``DistStoreError`` as
    ``TCPStore`` does.
    """

    def __init__(self, endpoints: str | Sequence[str], *, prefix: str = "", timeout: float = 30.0) -> None:
        super().__init__()
        urls = [endpoints] if isinstance(endpoints, str) else endpoints
        if not isinstance(urls, Sequence) or not urls or not all(isinstance(u, str) for u in urls):
            raise TypeError(f"endpoints must be a URL or a sequence of URLs, got {endpoints!r}")
        self._endpoints: list[tuple[str, int]] = []
        for url in urls:
            parts = urllib.parse.urlsplit(url)
            if parts.scheme != "http" or not parts.hostname or parts.port is None:
                raise ValueError(f"an etcd endpoint must be http://host:port, got {url!r}")
            self._endpoints.append((parts.hostname, parts.port))
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a string, got {type(prefix).__name__}")
        if not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self._prefix = prefix.encode()
        self._timeout = float(timeout)
        self._preferred = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        urls = ", ".join(f"http://{h}:{p}" for h, p in self._endpoints)
        return f"EtcdStore([{urls}], prefix={self._prefix.decode()!r})"

    # -- torch's Store interface ---------------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        """Set ``key`` to ``value``."""
        self._post("/v3/kv/put", {"key": self._key(key), "value": _b64(_raw(value))})

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store's timeout for it to be set."""
        return self._get_waiting(key, time.monotonic() + self._timeout)

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (missing: 0) atomically; return the new value."""
        while True:
            kv, _ = self._range(key)
            current = 0 if kv is None else int(base64.b64decode(kv["value"]))
            new = current + int(amount)
            if self._put_if(key, kv, str(new).encode()):
                return new

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """``TCPStore``'s compare-and-set: set ``desired`` if ``key`` holds ``expected``.

        A missing key counts as holding the empty value. Returns the value now held, or ``expected`` if the
        key is missing (and nothing was set).
        """
        want, new = _raw(expected), _raw(desired)
        while True:
            kv, _ = self._range(key)
            if kv is None and want:
                return want
            if kv is not None and base64.b64decode(kv["value"]) != want:
                return base64.b64decode(kv["value"])
            if self._put_if(key, kv, new):
                return new

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""
        return int(self._post("/v3/kv/deleterange", {"key": self._key(key)}).get("deleted", 0)) > 0

    def check(self, keys: list[str]) -> bool:
        """Whether every key in ``keys`` is set."""
        return all(self._range(k)[0] is not None for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Block until every key in ``keys`` is set, for ``timeout`` (default: the store's) at most."""
        seconds = self._timeout if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + seconds
        for key in keys:
            self._get_waiting(key, deadline)

    def num_keys(self) -> int:
        """The number of keys under this store's prefix."""
        end = _prefix_end(self._prefix) if self._prefix else b"\x00"
        body = {"key": _b64(self._prefix or b"\x00"), "range_end": _b64(end), "count_only": True}
        return int(self._post("/v3/kv/range", body).get("count", 0))

    def set_timeout(self, timeout: timedelta) -> None:
        """Set the default timeout of requests and of waits on missing keys."""
        self._timeout = timeout.total_seconds()

    # -- etcd ------------------------------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        return _b64(self._prefix + key.encode("utf-8", "surrogateescape"))

    def _range(self, key: str) -> tuple[dict[str, Any] | None, int]:
        """The key's record (or None) and the cluster's revision at the read."""
        reply = self._post("/v3/kv/range", {"key": self._key(key)})
        kvs = reply.get("kvs") or []
        return (kvs[0] if kvs else None), int(reply["header"]["revision"])

    def _put_if(self, key: str, kv: dict[str, Any] | None, value: bytes) -> bool:
        """Put ``value`` if the key is still as read (``kv``: its record, None: missing); whether it did."""
        b64key = self._key(key)
        if kv is None:
            compare = {"key": b64key, "target": "CREATE", "create_revision": "0"}
        else:
            compare = {"key": b64key, "target": "MOD", "mod_revision": kv["mod_revision"]}
        body = {"compare": [compare], "success": [{"request_put": {"key": b64key, "value": _b64(value)}}]}
        return bool(self._post("/v3/kv/txn", body).get("succeeded", False))

    def _get_waiting(self, key: str, deadline: float) -> bytes:
        while True:
            kv, revision = self._range(key)
            if kv is None:  # watch from the next revision: a put after this read is not missed
                kv = self._watch_for(key, revision + 1, deadline)
            if kv is not None:
                return base64.b64decode(kv.get("value", ""))

    def _watch_for(self, key: str, start: int, deadline: float) -> dict[str, Any] | None:
        """Block until ``key`` is put at or after revision ``start``; its record.

        None if etcd cancelled the watch (``start`` was compacted away meanwhile): read the key again.
        """
        body = json.dumps({"create_request": {"key": self._key(key), "start_revision": str(start)}})
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise StoreTimeoutError(f"{self!r}: key {key!r} was not set in time")
        conn, _ = self._open(remaining)
        try:
            conn.request("POST", "/v3/watch", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise ConnectionError(f"{self!r}: watch of {key!r} answered HTTP {response.status}")
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StoreTimeoutError(f"{self!r}: key {key!r} was not set in time")
                assert conn.sock is not None
                conn.sock.settimeout(remaining)
                try:
                    line = response.readline()
                except TimeoutError:
                    raise StoreTimeoutError(f"{self!r}: key {key!r} was not set in time") from None
                if not line:
                    raise ConnectionError(f"{self!r}: the watch of {key!r} ended before the key was set")
                result = json.loads(line).get("result", {})
                if result.get("canceled"):
                    return None
                for event in result.get("events") or []:
                    if event.get("type", "PUT") == "PUT":
                        return dict(event["kv"])
        finally:
            conn.close()

    def _open(self, timeout: float) -> tuple[http.client.HTTPConnection, int]:
        """A connection to the first endpoint that accepts one, starting at the last that answered."""
        errors = []
        n = len(self._endpoints)
        with self._lock:
            first = self._preferred
        for i in range(n):
            index = (first + i) % n
            host, port = self._endpoints[index]
            conn = http.client.HTTPConnection(host, port, timeout=max(timeout / n, 0.05))
            try:
                conn.connect()
            except OSError as exc:
                conn.close()
                errors.append(f"{host}:{port}: {exc}")
                continue
            conn.sock.settimeout(timeout)
            return conn, index
        raise TimeoutError(f"{self!r}: no etcd endpoint accepted a connection ({'; '.join(errors)})")

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One request, tried on each endpoint in turn until one answers, within the store's timeout."""
        deadline = time.monotonic() + self._timeout
        payload = json.dumps(body)
        failures = []
        while (remaining := deadline - time.monotonic()) > 0:
            # Leave time to try another member when one takes the whole bound (cut off from the majority).
            conn, index = self._open(remaining if len(self._endpoints) == 1 else max(remaining / 2, 0.05))
            try:
                conn.request("POST", path, payload, {"Content-Type": "application/json"})
                response = conn.getresponse()
                data = response.read()
            except OSError as exc:  # timed out or reset: a member without the majority, or gone
                failures.append(f"{self._endpoints[index][0]}:{self._endpoints[index][1]}: {exc}")
                with self._lock:
                    self._preferred = (index + 1) % len(self._endpoints)
                continue
            finally:
                conn.close()
            if response.status == 200:
                with self._lock:
                    self._preferred = index
                return dict(json.loads(data))
            failures.append(f"HTTP {response.status}: {data[:200]!r}")
            with self._lock:
                self._preferred = (index + 1) % len(self._endpoints)
            # Not a synchronisation: retry pacing. An error answer comes at once (a member that lost its
            # leader says so), and nothing signals when the cluster has a leader again; back off a little
            # rather than spin on it until the deadline.
            time.sleep(min(0.05 * len(failures), 0.5, max(deadline - time.monotonic(), 0)))
        raise TimeoutError(
            f"{self!r}: no etcd endpoint answered {path} within {self._timeout:g} s (cut off from the "
            f"cluster's majority?): {'; '.join(failures[-3:]) or 'no answer'}"
        )


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range end of a prefix)."""
    head = prefix.rstrip(b"\xff")
    return head[:-1] + bytes([head[-1] + 1]) if head else b"\x00"
