"""A store client whose every request is bounded: a silent server costs a ``TimeoutError``, not a hang.

torch's ``TCPStore`` client waits for the server's reply to ``add``, ``check``, ``compare_set``, ``get`` and
the others with no deadline (see :mod:`pc_distributed._bounded`). :class:`BoundedStore` runs every request of
a client on one worker thread in order (the client runs one request at a time anyway), so that a request stuck
on a silent server makes the later ones time out rather than pile up threads, and a request whose caller
already gave up is never sent.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from pc_distributed._bounded import WAIT_GRACE
from pc_distributed._torch_errors import is_connection_loss

__all__ = ["BoundedStore"]


class BoundedStore:
    """A store client whose every request raises ``TimeoutError`` instead of blocking past a deadline.

    Requests run in order on one daemon worker thread. ``set``, ``get``, ``multi_get``, ``add``, ``check``,
    ``compare_set`` and ``delete_key`` get ``timeout`` seconds; ``wait`` gets its own timeout plus
    :data:`WAIT_GRACE`. A request that times out keeps the worker until the server answers or the connection
    fails; the requests queued behind it time out in turn, and those whose callers gave up are dropped unsent.
    A request that fails because the connection to the server is lost (the process serving the store exited)
    raises ``ConnectionError`` naming the store and :attr:`server`, with torch's error as ``__cause__``.

    Args:
        store: The client (a torch ``Store``; a ``PrefixStore`` view is fine).
        timeout: Seconds of each short request (the World's ``dist_timeout``).
        label: Names the store in error messages.
        server: Names who serves the store, for the message of a lost connection.

    Attributes:
        server: Who serves the store (the World names rank 0's member once the names are known).
    """

    def __init__(
        self, store: Any, timeout: float, label: str, server: str = "the process serving it"
    ) -> None:
        self._store = store
        self._timeout = timeout
        self._label = label
        self.server = server
        # Not a ThreadPoolExecutor: its workers are joined at interpreter exit, and a stuck one would hang it.
        self._queue: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], str, tuple[Any, ...]] | None]
        self._queue = queue.SimpleQueue()
        self._closed = False
        threading.Thread(target=self._serve, name=f"pc-distributed-store: {label}", daemon=True).start()

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            future, op, args = item
            if not future.set_running_or_notify_cancel():
                continue  # its caller gave up before it was sent
            try:
                future.set_result(getattr(self._store, op)(*args))
            except BaseException as exc:  # handed to the caller
                future.set_exception(exc)

    def _call(self, op: str, timeout: float, *args: Any) -> Any:
        if self._closed:
            raise RuntimeError(f"{self._label} has been closed (World.stop)")
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue.put((future, op, args))
        try:
            return future.result(timeout)
        except (concurrent.futures.TimeoutError, TimeoutError) as exc:
            # The deadline passed here, or the store gave up itself (an EtcdStore cut off from its cluster's
            # majority): either way the message names this store; the store's own reason is kept.
            own = future.done() and not future.cancelled()
            future.cancel()  # never sent if it had not started
            raise TimeoutError(
                f"{self._label}: no answer to {op} within {timeout:g} s (the store's host is unreachable, "
                f"frozen or partitioned away){f': {exc}' if own else ''}"
            ) from None
        except (RuntimeError, OSError) as exc:
            if not is_connection_loss(exc):
                raise
            first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ConnectionError(
                f"{self._label}: lost the connection to the store during {op}: {self.server} has exited or "
                f"is unreachable ({type(exc).__name__}: {first_line})"
            ) from exc

    def set(self, key: str, value: str | bytes) -> None:
        """Torch's ``set``, bounded."""
        self._call("set", self._timeout, key, value)

    def get(self, key: str) -> bytes:
        """Torch's ``get``, bounded."""
        return bytes(self._call("get", self._timeout, key))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Torch's ``multi_get`` (every key's value in one request), bounded."""
        return [bytes(v) for v in self._call("multi_get", self._timeout, list(keys))]

    def add(self, key: str, amount: int) -> int:
        """Torch's ``add``, bounded."""
        return int(self._call("add", self._timeout, key, amount))

    def check(self, keys: Sequence[str]) -> bool:
        """Torch's ``check``, bounded."""
        return bool(self._call("check", self._timeout, list(keys)))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        """Torch's ``compare_set``, bounded."""
        return bytes(self._call("compare_set", self._timeout, key, expected, desired))

    def delete_key(self, key: str) -> bool:
        """Torch's ``delete_key``, bounded."""
        return bool(self._call("delete_key", self._timeout, key))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Torch's ``wait``; the deadline is ``timeout`` (default: the store's) plus :data:`WAIT_GRACE`."""
        seconds = self._timeout if timeout is None else timeout.total_seconds()
        args: tuple[Any, ...] = (list(keys),) if timeout is None else (list(keys), timeout)
        self._call("wait", seconds + WAIT_GRACE, *args)

    def close(self) -> None:
        """Stop taking requests; a request in progress is left to finish on its own (never blocks)."""
        self._closed = True
        self._queue.put(None)
