"""A rendezvous or store that accepts connections and never answers must not block a World past its timeouts.

The silent peer is a plain listening socket: the kernel completes the TCP handshake (backlog) and nothing ever
replies, as with a frozen rank 0. Without the bound, torch's TCPStore client waits for its handshake forever
and these tests hang until pytest-timeout fails them.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

import pc_distributed as pd
from pc_distributed._bounded import call_bounded


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
    assert pd.get_world() is None  # nothing left half-made: a new World may be created
    world = pd.World(name="solo")
    world.stop()


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
