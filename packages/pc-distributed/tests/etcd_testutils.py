"""A one-member etcd server on loopback for the EtcdStore and elastic tests (skipped where etcd is missing).

``etcd`` is a system binary (Debian's ``etcd-server``), not a Python package: ``.ci/run`` installs it and sets
``PC_REQUIRE_ETCD=1``, which turns a missing binary into a failure instead of a skip, so CI cannot pass by
skipping these tests.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

__all__ = ["etcd_argv", "etcd_server", "free_port", "require_etcd"]


def require_etcd() -> str:
    """The path of the ``etcd`` binary; skip the test without it (fail where ``PC_REQUIRE_ETCD`` is set)."""
    path = shutil.which("etcd")
    if path is None:
        if os.environ.get("PC_REQUIRE_ETCD"):
            pytest.fail("PC_REQUIRE_ETCD is set but no etcd binary is on PATH (apt install etcd-server)")
        pytest.skip("no etcd binary on PATH (Debian: apt install etcd-server)")
    return path


def free_port() -> int:
    """A port the kernel just handed out on loopback (random, not fixed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def etcd_argv(
    binary: str,
    name: str,
    addr: str,
    client: int,
    peer: int,
    data: Path,
    cluster: Sequence[tuple[str, str, int]],
) -> list[str]:
    """The command line of etcd member ``name`` at ``addr`` in a new ``cluster`` (name, addr, peer port)."""
    initial = ",".join(f"{n}=http://{a}:{p}" for n, a, p in cluster)
    return [
        binary,
        f"--name={name}",
        f"--data-dir={data}",
        f"--listen-client-urls=http://{addr}:{client}",
        f"--advertise-client-urls=http://{addr}:{client}",
        f"--listen-peer-urls=http://{addr}:{peer}",
        f"--initial-advertise-peer-urls=http://{addr}:{peer}",
        f"--initial-cluster={initial}",
        "--initial-cluster-state=new",
        "--log-level=error",
    ]


def _wait_listening(proc: subprocess.Popen[bytes], addr: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((addr, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd did not listen on {addr}:{port} within {timeout:g} s") from None
        try:  # a bounded wait that also notices an etcd that exited
            code = proc.wait(timeout=0.05)
        except subprocess.TimeoutExpired:
            continue
        raise RuntimeError(f"etcd exited with {code} before listening on {addr}:{port}")


@contextmanager
def etcd_server(data: Path) -> Iterator[str]:
    """A one-member etcd cluster on loopback for the block; yields its client URL. Killed and reaped after."""
    binary = require_etcd()
    client, peer = free_port(), free_port()
    argv = etcd_argv(binary, "solo", "127.0.0.1", client, peer, data / "etcd", [("solo", "127.0.0.1", peer)])
    with open(data / "etcd.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_listening(proc, "127.0.0.1", client, 30.0)
        yield f"http://127.0.0.1:{client}"
    finally:
        proc.kill()
        proc.wait(30)
