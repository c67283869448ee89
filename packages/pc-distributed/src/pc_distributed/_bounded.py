"""Run a call that torch may block in forever on a helper thread, and give up on it after a deadline.

torch's ``TCPStore`` bounds ``wait`` by its timeout, but not the other requests: ``add``, ``check``,
``compare_set`` and ``get`` wait for the server's reply with no deadline, and the client's constructor
waits for the server's handshake with none either. When the store's host is partitioned away or frozen
(the TCP connection stays open, nothing answers) those calls block until TCP gives up on the connection,
which takes about 15 minutes with Linux's defaults (``net.ipv4.tcp_retries2``) and forever on a listening
socket that accepts and never answers. Even ``wait`` is unbounded against a server that stopped answering:
after its timeout the client asks the server to cancel the wait and blocks for the acknowledgement.

:func:`call_bounded` runs such a call on a daemon thread and raises ``TimeoutError`` when the deadline passes;
the abandoned thread stays blocked until the connection fails (or the process exits). The store layer's
:class:`~pc_distributed._store.BoundedStore` does the same for every request of a store client.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["WAIT_GRACE", "call_bounded"]

# Seconds a store wait may overrun its own timeout (the server's answer to it) before it counts as unanswered.
WAIT_GRACE = 2.0

T = TypeVar("T")


def call_bounded(fn: Callable[[], T], timeout: float, what: str) -> T:
    """Return ``fn()``, or raise ``TimeoutError`` naming ``what`` if it has not returned within ``timeout``.

    ``fn``'s own exception is re-raised in the caller. On a timeout ``fn`` keeps running on its daemon thread
    (Python cannot interrupt a thread blocked in C++); its result, if it ever comes, is dropped.

    Raises:
        TimeoutError: If ``fn`` did not finish within ``timeout`` seconds.
    """
    done = threading.Event()
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the caller
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name=f"pc-distributed-bounded: {what}", daemon=True).start()
    if not done.wait(timeout):
        raise TimeoutError(f"{what}: no answer within {timeout:g} s")
    # Taken out of the box: the error's traceback holds run's frame, which holds the box (a reference cycle
    # that would keep what fn's frames hold, a process group say, alive until the garbage collector runs).
    if "error" in box:
        raise box.pop("error")  # type: ignore[misc]
    return box.pop("value")  # type: ignore[return-value]
