"""A multi-host harness for tests: N simulated hosts as Linux network namespaces, each running torchrun.

Topology (nothing is added to the caller's own network namespace)::

    <tag>-sw   a "switch" namespace holding the bridge ``br0``; one port ``p<i>`` per host
    <tag>-h<i> host ``i``: ``lo`` and ``eth0`` (10.231.0.<i+1>/24), the other end of ``p<i>``

Every name carries a per-run tag (pid + random), so parallel runs never collide, and the addresses exist
only inside the namespaces made here. :class:`SimHosts` is a context manager whose exit (also on an exception
or Ctrl-C) kills every process in its host namespaces (they are all ours: nothing else runs there) and
deletes the namespaces, which removes their links and addresses with them. A run killed outright (SIGKILL, a
CI timeout) cannot clean up: the next :class:`SimHosts` removes the namespaces of runs whose process is gone
(:func:`sweep_stale`).

Fault helpers: :meth:`SimHosts.cut` / :meth:`SimHosts.heal` take a host's switch port down / up (its cable
pulled: the host's ``eth0`` loses carrier, its packets go nowhere and nobody's reach it);
:meth:`SimHosts.partition` moves some hosts' ports to a second bridge (two sides that each still talk);
:meth:`SimHosts.kill_host` SIGKILLs every process of a host; :meth:`TorchrunJob.kill_workers` only its
torchrun's workers (the agent lives on and may restart them); :meth:`SimHosts.freeze` /
:meth:`SimHosts.thaw` SIGSTOP / SIGCONT them.

Needs root and ``ip netns``; :func:`unavailable_reason` says why not, for a skip.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

__all__ = [
    "SUBNET",
    "SimHosts",
    "TorchrunJob",
    "sweep_stale",
    "torchrun_args",
    "unavailable_reason",
    "wait_for",
]

SUBNET = "10.231.0"
IFNAME = "eth0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (None: they can). Tries one and deletes it."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "simulated hosts need root (ip netns add); CI runs these tests as root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"pcmh{os.getpid()}-{secrets.token_hex(2)}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "delete", probe, check=False)
    return None


# The namespaces of a run: pcmh<pid of the run>-<4 hex digits>-<role>.
_OURS = re.compile(r"^pcmh(\d+)-[0-9a-f]{4}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        pass
    return True


def _namespace_pids(ns: str) -> list[int]:
    """Every process running in namespace ``ns``."""
    return [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]


def _signal_namespace(ns: str, sig: signal.Signals) -> list[int]:
    """Send ``sig`` to every process of namespace ``ns``; return their pids."""
    pids = _namespace_pids(ns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return pids


def sweep_stale() -> list[str]:
    """Delete the namespaces of runs whose process is gone (killed before their teardown); return their names.

    Their processes are killed first (a namespace's processes are all the harness's own). A namespace whose
    run's pid is alive, or that is not named as the harness names them, is left alone.
    """
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    stale = []
    for line in listed:
        name = line.split(" ", 1)[0]
        found = _OURS.match(name)
        if found is None or _alive(int(found.group(1))):
            continue
        _signal_namespace(name, signal.SIGKILL)
        _ip("netns", "delete", name, check=False)
        stale.append(name)
    return stale


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, period: float = 0.05) -> None:
    """Poll ``predicate`` until true; raise ``TimeoutError`` naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(period)


def free_port() -> int:
    """A port number (the namespaces are fresh: every port is free in them; this one is random, not fixed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SimHosts:
    """``n`` simulated hosts on one bridge (a context manager; see the module docstring).

    Args:
        n: Number of hosts.
    """

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = n
        self.tag = f"pcmh{os.getpid()}-{secrets.token_hex(2)}"
        self.switch = f"{self.tag}-sw"
        self.hosts = [f"{self.tag}-h{i}" for i in range(n)]
        self._made: list[str] = []

    # -- set-up / teardown ---
    def __enter__(self) -> SimHosts:
        sweep_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _build(self) -> None:
        for ns in (self.switch, *self.hosts):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.hosts):
            port = f"p{i}"
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", ns)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")

    def close(self) -> None:
        """Kill every process of every host, then delete the namespaces (idempotent, never raises)."""
        for i in range(len(self._made) - 1):
            with contextlib.suppress(Exception):  # teardown goes on
                self.kill_host(i)
        for ns in reversed(self._made):
            _ip("netns", "delete", ns, check=False)
        self._made.clear()

    # -- addresses and processes ---
    def addr(self, i: int) -> str:
        """Host ``i``'s address (exists only inside the namespaces)."""
        return f"{SUBNET}.{i + 1}"

    def pids(self, i: int) -> list[int]:
        """Every process running in host ``i``'s namespace."""
        return _namespace_pids(self.hosts[i])

    def popen(
        self, i: int, argv: Sequence[str], env: dict[str, str], stdout: IO[bytes] | int | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in host ``i``'s namespace, in a session of its own."""
        return subprocess.Popen(
            ["ip", "netns", "exec", self.hosts[i], *argv],
            env=env,
            stdout=stdout,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    # -- faults ---
    def cut(self, i: int) -> None:
        """Pull host ``i``'s cable: its switch port goes down (both directions silent)."""
        _ip("-n", self.switch, "link", "set", f"p{i}", "down")

    def heal(self, i: int) -> None:
        """Plug host ``i``'s cable back in."""
        _ip("-n", self.switch, "link", "set", f"p{i}", "up")

    def partition(self, away: Sequence[int]) -> None:
        """Split the network in two: the hosts ``away`` move to a second switch (bridge ``br1``).

        The hosts on each side still reach each other, and nothing of the other side (a network partition,
        not a host cut off). The second bridge goes with the switch's namespace.
        """
        if _ip("-n", self.switch, "link", "show", "br1", check=False).returncode != 0:
            _ip("-n", self.switch, "link", "add", "br1", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br1", "up")
        for i in away:
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br1")

    def _signal(self, i: int, sig: signal.Signals) -> list[int]:
        return _signal_namespace(self.hosts[i], sig)

    def kill_host(self, i: int) -> None:
        """SIGKILL every process of host ``i`` (a frozen one included) and wait until none is left."""
        self._signal(i, signal.SIGKILL)
        self._signal(i, signal.SIGCONT)
        wait_for(lambda: not self.pids(i), 30, f"the processes of host {i} to die")

    def kill_workers(self, i: int, keep: Sequence[int]) -> list[int]:
        """SIGKILL every process of host ``i`` but the pids in ``keep`` (its torchrun agent); return them."""
        killed = [pid for pid in self.pids(i) if pid not in keep]
        for pid in killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return killed

    def freeze(self, i: int) -> list[int]:
        """SIGSTOP every process of host ``i``; return their pids."""
        return self._signal(i, signal.SIGSTOP)

    def thaw(self, i: int) -> None:
        """SIGCONT every process of host ``i``."""
        self._signal(i, signal.SIGCONT)


def torchrun_args(
    addrs: Sequence[str], i: int, nproc_per_node: int, port: int, rdzv: str, max_restarts: int, run_id: str
) -> list[str]:
    """The torchrun options of host ``i`` of hosts at ``addrs`` (the ones docs/multihost.md shows).

    Static rendezvous: host 0's agent serves the store at ``--master_addr``; ``--node_rank`` orders the
    hosts. c10d: host 0's agent serves the rendezvous store (``is_host=1``; the simulated hosts share one
    hostname, so torch could not tell by name), the hosts' order is whatever the rendezvous makes it, and
    ``--local_addr`` gives each agent the address its workers are told to reach (torch would otherwise
    announce the machine's host name).
    """
    common = [
        f"--nnodes={len(addrs)}",
        f"--nproc_per_node={nproc_per_node}",
        f"--max_restarts={max_restarts}",
    ]
    if rdzv == "static":
        return [*common, f"--node_rank={i}", f"--master_addr={addrs[0]}", f"--master_port={port}"]
    return [
        *common,
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={addrs[0]}:{port}",
        f"--rdzv_id={run_id}",
        f"--rdzv_conf=is_host={1 if i == 0 else 0}",
        f"--local_addr={addrs[i]}",
    ]


class TorchrunJob:
    """One torchrun per host (rendezvous at host 0), ``nproc_per_node`` workers each (``PC_MH_HOST``: host).

    Args:
        hosts: The simulated hosts.
        script: The worker script and its arguments.
        log_dir: Where each host's torchrun output goes (``torchrun-<i>.log``).
        nproc_per_node: Workers per host.
        extra_env: Added to the workers' environment.
        rdzv: ``"static"`` (``--master_addr``/``--node_rank``) or ``"c10d"`` (``--rdzv_backend=c10d``).
        max_restarts: torchrun's ``--max_restarts``.
    """

    def __init__(
        self,
        hosts: SimHosts,
        script: Sequence[str],
        log_dir: Path,
        nproc_per_node: int = 2,
        extra_env: dict[str, str] | None = None,
        rdzv: str = "static",
        max_restarts: int = 0,
    ) -> None:
        if rdzv not in ("static", "c10d"):
            raise ValueError(f"rdzv must be 'static' or 'c10d', got {rdzv!r}")
        self.hosts = hosts
        self.rdzv = rdzv
        self.max_restarts = max_restarts
        self.port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs = [log_dir / f"torchrun-{i}.log" for i in range(hosts.n)]
        env = dict(os.environ)
        env.update(
            {
                "GLOO_SOCKET_IFNAME": IFNAME,
                "TP_SOCKET_IFNAME": IFNAME,
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
                **(extra_env or {}),
            }
        )
        for i in range(hosts.n):
            argv = [sys.executable, "-m", "torch.distributed.run", *self.torchrun_args(i, nproc_per_node)]
            with open(self.logs[i], "wb") as log:
                host_env = {**env, "PC_MH_HOST": str(i)}  # which namespace: the tests' ground truth
                self.procs.append(hosts.popen(i, [*argv, *script], host_env, stdout=log))

    def torchrun_args(self, i: int, nproc_per_node: int) -> list[str]:
        """The torchrun options of host ``i`` (see :func:`torchrun_args`)."""
        addrs = [self.hosts.addr(j) for j in range(self.hosts.n)]
        return torchrun_args(
            addrs, i, nproc_per_node, self.port, self.rdzv, self.max_restarts, run_id=self.hosts.tag
        )

    def kill_workers(self, i: int) -> list[int]:
        """SIGKILL the workers of host ``i`` (every process there but its torchrun agent); return the pids."""
        return self.hosts.kill_workers(i, keep=[self.procs[i].pid])

    def wait(self, timeout: float) -> list[int]:
        """Wait for every torchrun to exit; return their exit codes (TimeoutError naming the logs if not)."""
        deadline = time.monotonic() + timeout
        codes = []
        for proc, log in zip(self.procs, self.logs, strict=True):
            try:
                codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise TimeoutError(
                    f"torchrun did not exit in {timeout:g} s; log:\n{self.tail(log)}"
                ) from None
        return codes

    def tail(self, log: Path, chars: int = 4000) -> str:
        """The end of a host's log."""
        try:
            return log.read_text(errors="replace")[-chars:]
        except OSError:
            return "<no log>"

    def all_logs(self) -> str:
        """Every host's log tail, for assertion messages."""
        return "\n".join(f"--- host {i} ---\n{self.tail(log)}" for i, log in enumerate(self.logs))
