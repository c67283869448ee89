"""A rendezvous or store that accepts connections and never answers must not block a World past its timeouts.

The silent peer is a plain listening socket: the kernel completes the TCP handshake (backlog) and nothing ever
replies, as with a frozen rank 0. Without the bound, torch's TCPStore client waits for its handshake forever
and these tests hang until pytest-timeout fails them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

import pc_distributed as pd
from pc_distributed._bounded import call_bounded
from pc_distributed._store import BoundedStore


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


# torch's own store requests inside init_process_group, new_group and RPC's start-up have no deadline against
# a silent store. These run in a child process: the bounded call leaves a thread blocked in torch, and a
# half-made process group or RPC agent must not leak into this test process.
_CHILD_PRELUDE = """
import os, socket, sys, threading
import torch.distributed as dist
from pc_distributed import _torch_dist

def report(fn):
    try:
        fn()
        print("RESULT no error", flush=True)
    except BaseException as exc:
        print(f"RESULT {type(exc).__name__}: {exc}", flush=True)
    os._exit(0)
"""

_NEW_GROUP = """
class SwitchStore(dist.Store):
    '''A HashStore that goes silent on request: every request then blocks until released, then fails.'''

    def __init__(self):
        super().__init__()
        self.inner = dist.HashStore()
        self.silent = threading.Event()
        self.release = threading.Event()

    def _gate(self):
        if self.silent.is_set():
            self.release.wait(60)
            raise RuntimeError("released")

    def set(self, k, v): self._gate(); return self.inner.set(k, v)
    def get(self, k): self._gate(); return self.inner.get(k)
    def add(self, k, n): self._gate(); return self.inner.add(k, n)
    def check(self, keys): self._gate(); return self.inner.check(keys)
    def compare_set(self, k, e, d): self._gate(); return self.inner.compare_set(k, e, d)
    def delete_key(self, k): self._gate(); return self.inner.delete_key(k)
    def num_keys(self): return self.inner.num_keys()
    def set_timeout(self, t): pass
    def wait(self, keys, timeout=None):
        self._gate()
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

store = SwitchStore()
_torch_dist.init_pg(store, "gloo", 0, 1, 30)
_torch_dist.new_group([0], 30, None)  # answered: the wrapper passes a working store through
store.silent.set()
report(lambda: _torch_dist.new_group([0], 1, None))
"""

_RPC_START = """
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen(16)
url = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
from pc_distributed.rpc._backends import BackendSetup, start_backend

def no_store():
    raise AssertionError("TensorPipe makes no links on the store")

setup = BackendSetup(
    member="b", rank=1, world_size=2, names=("a", "b"), timeout=30, start_timeout=1, busy_poll=False,
    link_store=no_store, rpc_init_method=lambda: url,
)
report(lambda: start_backend("tensorpipe", setup))
"""


def _run_child(body: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD_PRELUDE + body],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert results, f"no result; rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-2000:]}"
    return results[-1]


def test_new_group_on_a_silent_store_raises_timeout() -> None:
    # Without the bound the child blocks in gloo's rendezvous until the store is released (60 s), and then
    # fails with the store's RuntimeError("released") instead.
    assert _run_child(_NEW_GROUP) == "RESULT TimeoutError: new_group([0]): no answer within 3 s"


def test_rpc_start_up_on_a_silent_rendezvous_raises_timeout() -> None:
    result = _run_child(_RPC_START)
    assert result.startswith("RESULT TimeoutError: RPC start-up of 'b' on tcp://127.0.0.1:"), result


def test_world_names_an_unreachable_rendezvous() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(TimeoutError, match="not reachable within 2 s") as info:
        pd.World(name="b", rank=1, world_size=2, dist_timeout=2, dist_init_method=url)
    assert url in str(info.value)
    assert "MASTER_ADDR" in str(info.value)  # says what to check
    assert pd.get_world() is None


def test_rank_zero_binds_exactly_the_given_address() -> None:
    # 10.255.255.1 is no address of this host: serving on every interface would have succeeded.
    from pc_distributed.world import _rendezvous
    from pc_distributed.world._env import resolve_world_spec

    spec = resolve_world_spec(0, 1, None, None, env={"MASTER_PORT": "0"}, addr="10.255.255.1")
    with pytest.raises(OSError, match=r"rank 0 cannot serve the rendezvous store on 10\.255\.255\.1:0"):
        _rendezvous.connect(spec, "a", 0, 1, 2)
