"""A rendezvous or store that accepts connections and never answers must not block a World past its timeouts.

The silent peer is a plain listening socket: the kernel completes the TCP handshake (backlog) and nothing ever
replies, as with a frozen rank 0. Without the bound, torch's TCPStore client waits for its handshake forever
and these tests hang until pytest-timeout fails them.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

import pc_distributed as pd
from pc_distributed._bounded import BoundedStore, call_bounded


@pytest.fixture
def silent_address() -> Iterator[str]:
    """``tcp://127.0.0.1:<port>`` of a socket that listens and never accepts or answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def test_world_raises_timeout_on_a_silent_rendezvous(silent_address: str) -> None:
    with pytest.raises(TimeoutError, match="rendezvous store") as info:
        pd.World(name="b", rank=1, world_size=2, dist_timeout=2, dist_init_method=silent_address)
    assert silent_address in str(info.value)
    # Nothing left half-made. (No World is started in this process to show it: RPC's state would be inherited
    # by the forked worlds of the other tests.)
    assert pd.get_world() is None


def test_call_bounded_returns_value_and_reraises() -> None:
    assert call_bounded(lambda: 41 + 1, 5, "sum") == 42

    def boom() -> None:
        raise KeyError("inner")

    with pytest.raises(KeyError, match="inner"):
        call_bounded(boom, 5, "boom")


def test_call_bounded_gives_up_on_a_blocked_call() -> None:
    release = threading.Event()
    try:
        with pytest.raises(TimeoutError, match=r"blocked thing: no answer within 0\.2 s"):
            call_bounded(release.wait, 0.2, "blocked thing")
    finally:
        release.set()


class _StuckStore:
    """A store whose ``add`` blocks until released; records every request that reached it."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.seen: list[str] = []

    def add(self, key: str, amount: int) -> int:
        self.seen.append(f"add {key}")
        self.release.wait(30)
        return amount

    def set(self, key: str, value: str) -> None:
        self.seen.append(f"set {key}")


def test_bounded_store_times_out_and_drops_requests_whose_callers_gave_up() -> None:
    inner = _StuckStore()
    store = BoundedStore(inner, 0.2, "the test store")
    try:
        with pytest.raises(TimeoutError, match=r"the test store: no answer to add within 0\.2 s"):
            store.add("n", 1)
        with pytest.raises(TimeoutError, match="no answer to set"):
            store.set("late", "1")  # queued behind the stuck add, never sent
        inner.release.set()
        store.set("after", "1")  # the worker is free again: requests go through
        assert inner.seen == ["add n", "set after"]
    finally:
        inner.release.set()
        store.close()
    with pytest.raises(RuntimeError, match="has been closed"):
        store.set("x", "1")


def test_bounded_store_passes_real_store_results() -> None:
    raw = dist.HashStore()
    store = BoundedStore(raw, 5, "hash")
    try:
        store.set("k", "v")
        assert store.get("k") == b"v"
        assert store.add("n", 2) == 2
        assert store.check(["k"])
        assert store.compare_set("k", "v", "w") == b"w"
        store.wait(["k"], timedelta(seconds=1))
        assert store.delete_key("k")
    finally:
        store.close()
