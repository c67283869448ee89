"""ElasticDataParallel on simulated hosts (network namespaces): a host cut off, and a network partition.

Each test starts one torchrun per host (multihost.py; static rendezvous, one worker each: the member ``h<i>``
of multihost_elastic_worker.py), so the store is the one host 0's agent serves. Every member holds inside step
``HOLD`` (after its quorum formed, before the all-reduce); the test then injects the fault and lets them go.

The trainer's rule is that the store decides (docs/elastic.md): the members that still reach it abort the
step they were in, leave out those whose heartbeat stopped, and finish; the members that cannot reach it raise
(``TimeoutError``/``ConnectionError`` naming the store) instead of going on among themselves, so there is no
split brain even where they still reach each other. The survivors' final parameters must be equal, and equal
to a single-process replay of their quorum log (float64, to 1e-12). Bounds are the trainer's configured
timeouts plus a generous margin (a noisy shared machine).

Needs root and ``ip netns`` (skipped otherwise, with the reason); run with ``nox -s multihost``.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import multihost_elastic_worker as worker
import pytest
import torch
from multihost import SimHosts, TorchrunJob, free_port, unavailable_reason, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "pc-distributed" / "tests"))
import etcd_testutils  # the package tests' etcd command line and binary check

_REASON = unavailable_reason()
pytestmark = [
    pytest.mark.multihost,
    pytest.mark.slow,
    pytest.mark.skipif(_REASON is not None, reason=f"multi-host tests: {_REASON}"),
    pytest.mark.timeout(360),
]

WORKER = str(Path(worker.__file__).resolve())
HOSTS = 4
QUORUM_TIMEOUT = 20.0  # the members' quorum_timeout: how long a boundary below min_members waits, then raises
START = 150.0  # seconds for 4 torchruns (agent and worker each) to import torch and reach step HOLD
MARGIN = 60.0  # added to every bound (noisy shared machines)
# A cut-off member: its all-reduce times out, then the store requests of the decision (and its leave) do.
LOST_BOUND = worker.COLLECTIVE_TIMEOUT + 2 * worker.STORE_TIMEOUT + MARGIN
# The others: the all-reduce times out, the step is aborted, the next quorum waits until the lost members'
# heartbeats are member_timeout old (at most about twice that after the fault), then commits the step.
RECOVER_BOUND = worker.COLLECTIVE_TIMEOUT + 2 * worker.MEMBER_TIMEOUT + MARGIN
# A member that reaches the store alone (the others lost), below min_members: the all-reduce times out, the
# step is aborted, and the next boundary waits quorum_timeout for enough members, then raises.
ALONE_BOUND = worker.COLLECTIVE_TIMEOUT + QUORUM_TIMEOUT + MARGIN
# Every member's report, the steps after the fault included.
RESULTS = max(LOST_BOUND, RECOVER_BOUND, ALONE_BOUND) + MARGIN


@pytest.fixture
def hosts() -> Iterator[SimHosts]:
    with SimHosts(HOSTS) as made:
        yield made


def _run(
    sim: SimHosts, out: Path, min_members: int, fault: Callable[[], None], etcd: str | None = None
) -> tuple[dict[int, Any], float, str]:
    """Start the members, inject ``fault`` once every member holds inside step HOLD, collect the reports.

    ``etcd``: the client URLs of an etcd cluster (comma-separated, by host) for the members' store.
    """
    script = [WORKER, str(out), str(min_members), str(QUORUM_TIMEOUT)]
    job = TorchrunJob(sim, script, out, nproc_per_node=1, extra_env={"PC_MH_ETCD": etcd} if etcd else None)

    def files(prefix: str) -> list[Path]:
        return [out / f"{prefix}{i}" for i in range(HOSTS)]

    def all_there(paths: list[Path], what: str) -> Callable[[], bool]:
        def check() -> bool:
            if all(p.exists() for p in paths):
                return True
            if all(proc.poll() is not None for proc in job.procs):  # nothing more will come
                raise AssertionError(f"every torchrun exited before {what}\n{job.all_logs()}")
            return False

        return check

    try:
        wait_for(all_there(files("held"), "every member held"), START, "every member inside step HOLD")
        fault()
        t_go = time.time()
        (out / "go").write_text("1")
        reports = [out / f"member{i}.json" for i in range(HOSTS)]
        wait_for(all_there(reports, "every member reported"), RESULTS, "every member's report")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{job.all_logs()}") from None
    obs = {i: json.loads(p.read_text()) for i, p in enumerate(reports)}
    for _, o in sorted(obs.items()):
        end = o["error"]["t"] if "error" in o else o["t_done"]
        what = f"raised {o['error']['type']}" if "error" in o else "finished"
        print(
            f"[elastic multihost] {o['name']}: {what} {end - t_go:.2f}s after the fault", o.get("error", "")
        )
    return obs, t_go, job.all_logs()


def _merged_log(obs: dict[int, Any], hosts: list[int]) -> list[tuple[int, tuple[str, ...]]]:
    """The hosts' quorum logs merged: they must agree on every step's members and cover every step."""
    steps: dict[int, tuple[str, ...]] = {}
    for i in hosts:
        for step, members in obs[i]["log"]:
            assert steps.setdefault(step, tuple(members)) == tuple(members), (i, step, members, steps[step])
    assert sorted(steps) == list(range(worker.STEPS)), steps
    return sorted(steps.items())


def _check_lost(obs: dict[int, Any], t_go: float, logs: str, lost: list[int]) -> None:
    """The ``lost`` members (cut off from the store) raised an error naming the store, in bounded time, and
    committed no step after the fault."""
    for i in lost:
        o = obs[i]
        assert "error" in o, (o, logs)  # it stopped rather than training on alone or with its side
        assert o["error"]["type"] in ("TimeoutError", "ConnectionError"), (o, logs)
        assert "elastic store" in o["error"]["message"], (o, logs)  # it names what it lost
        assert o["error"]["t"] - t_go < LOST_BOUND, (o, logs)
        assert [step for step, _ in o["log"]] == list(range(worker.HOLD)), (o, logs)  # no step after the cut
        assert o["close_s"] < worker.STORE_TIMEOUT + MARGIN, (o, logs)


def _check(obs: dict[int, Any], t_go: float, logs: str, lost: list[int]) -> None:
    """The members on the store's side finished, equal to the replay; the ``lost`` ones raised, bounded."""
    survivors = [i for i in range(HOSTS) if i not in lost]
    everyone = {f"h{i}" for i in range(HOSTS)}
    gone = {f"h{i}" for i in lost}
    for i in survivors:
        o = obs[i]
        assert "error" not in o, (o, logs)
        assert o["aborted"] >= 1, (o, logs)  # the step the fault hit had the lost members in its quorum
        assert o["t_hold_committed"] - t_go < RECOVER_BOUND, (o, logs)
    log = _merged_log(obs, survivors)
    for step, members in log:
        if step < worker.HOLD:
            assert set(members) == everyone, log  # the lost members trained until the fault
        else:
            assert not gone & set(members), log  # and never after it
    expected = worker.replay(log)
    for i in survivors:
        assert obs[i]["params"] == obs[survivors[0]]["params"], (i, logs)  # one average, applied by all
        for got, want in zip(obs[i]["params"], expected, strict=True):
            torch.testing.assert_close(
                torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-12, msg=f"member h{i}"
            )
    _check_lost(obs, t_go, logs, lost)


def test_a_host_cut_off_mid_step_stops_and_the_others_finish(hosts: SimHosts, tmp_path: Path) -> None:
    obs, t_go, logs = _run(hosts, tmp_path, 2, lambda: hosts.cut(3))
    _check(obs, t_go, logs, lost=[3])


_LISTEN = (
    "import socket, sys; s = socket.create_server((sys.argv[1], 0)); print(s.getsockname()[1], flush=True); "
    "s.settimeout(30); s.accept()"
)


def _reaches(sim: SimHosts, src: int, dst: int) -> bool:
    """Whether host ``src`` can open a TCP connection to host ``dst`` (2 s)."""
    env = dict(os.environ)
    listener = sim.popen(dst, [sys.executable, "-c", _LISTEN, sim.addr(dst)], env, stdout=subprocess.PIPE)
    try:
        assert listener.stdout is not None
        port = int(listener.stdout.readline())
        probe = f"import socket; socket.create_connection(('{sim.addr(dst)}', {port}), timeout=2)"
        done = subprocess.run(
            ["ip", "netns", "exec", sim.hosts[src], sys.executable, "-c", probe],
            capture_output=True,
            timeout=30,
        )
        return done.returncode == 0
    finally:
        listener.kill()
        listener.wait(30)


def test_a_partition_stops_the_side_without_the_store_and_the_other_side_finishes(
    hosts: SimHosts, tmp_path: Path
) -> None:
    """Hosts 2 and 3 are split from 0 and 1 (host 0's agent serves the store) while they still reach each
    other: they could form a quorum group of their own, but the store decides, so they stop (no split brain);
    hosts 0 and 1 (``min_members`` 2) finish."""

    def split() -> None:
        hosts.partition([2, 3])
        assert _reaches(hosts, 2, 3)  # a partition: the away side still talks
        assert not _reaches(hosts, 2, 0)

    obs, t_go, logs = _run(hosts, tmp_path, 2, split)
    _check(obs, t_go, logs, lost=[2, 3])


def _etcd_cluster(sim: SimHosts, data: Path) -> str:
    """An etcd member on every host, one cluster; the client URLs by host, comma-separated, once it answers.

    The processes end with the hosts (SimHosts kills everything in their namespaces).
    """
    binary = etcd_testutils.require_etcd()
    ports = [(free_port(), free_port()) for _ in range(sim.n)]
    cluster = [(f"e{i}", sim.addr(i), peer) for i, (_, peer) in enumerate(ports)]
    for i, (client, peer) in enumerate(ports):
        data_dir = data / f"etcd{i}"
        argv = etcd_testutils.etcd_argv(binary, f"e{i}", sim.addr(i), client, peer, data_dir, cluster)
        with open(data / f"etcd-{i}.log", "wb") as log:
            sim.popen(i, argv, dict(os.environ), stdout=log)
    urls = ",".join(f"http://{sim.addr(i)}:{client}" for i, (client, _) in enumerate(ports))
    probe = f"import pc_distributed as pd; pd.EtcdStore({urls.split(',')!r}, timeout=60).set('up', '1')"
    done = subprocess.run(
        ["ip", "netns", "exec", sim.hosts[0], sys.executable, "-c", probe], capture_output=True, timeout=90
    )
    logs = "".join((data / f"etcd-{i}.log").read_text(errors="replace")[-2000:] for i in range(sim.n))
    assert done.returncode == 0, (done.stderr.decode(errors="replace"), logs)
    return urls


def test_with_an_etcd_store_the_majority_split_from_host_0_goes_on_and_host_0_stops(
    hosts: SimHosts, tmp_path: Path
) -> None:
    """The store is an etcd cluster with a member on every host (no store host to lose). Hosts 1, 2 and 3 (a
    majority of the members and of etcd's cluster) are split from host 0 inside step HOLD, ``min_members``
    3: the majority aborts the step, leaves host 0 out and finishes, equal to the replay of its log; host 0,
    whose etcd member lost the cluster's majority, gets no answer from the store and raises a
    ``TimeoutError`` naming it, having committed nothing after the split (no split brain)."""
    urls = _etcd_cluster(hosts, tmp_path)

    def split() -> None:
        hosts.partition([1, 2, 3])
        assert _reaches(hosts, 1, 3)
        assert not _reaches(hosts, 1, 0)

    obs, t_go, logs = _run(hosts, tmp_path, 3, split, etcd=urls)
    _check(obs, t_go, logs, lost=[0])


def test_a_majority_split_from_the_store_stops_and_so_does_the_store_side_below_min_members(
    hosts: SimHosts, tmp_path: Path
) -> None:
    """Hosts 1, 2 and 3 (a majority) are split from host 0, whose agent serves the store, with
    ``min_members`` 3 (a majority of 4). The majority cannot decide without the store, and the store's side is
    below ``min_members``: every member stops with an error naming why, and no step is committed after the
    split by anyone (no side trains on: no split brain)."""

    def split() -> None:
        hosts.partition([1, 2, 3])
        assert _reaches(hosts, 1, 3)  # the majority still talks among itself
        assert not _reaches(hosts, 1, 0)

    obs, t_go, logs = _run(hosts, tmp_path, 3, split)
    _check_lost(obs, t_go, logs, lost=[1, 2, 3])
    alone = obs[0]
    assert alone.get("error", {}).get("type") == "TimeoutError", (alone, logs)
    message = alone["error"]["message"]
    assert "a quorum needs at least 3 members, only 1 (['h0'])" in message, (alone, logs)
    named = re.search(r"dead or left (\[[^]]*\])", message)
    assert named is not None, (alone, logs)
    assert sorted(ast.literal_eval(named.group(1))) == ["h1", "h2", "h3"], (alone, logs)  # who is missing
    assert alone["error"]["t"] - t_go < ALONE_BOUND, (alone, logs)
    assert [step for step, _ in alone["log"]] == list(range(worker.HOLD)), (alone, logs)
    assert alone["aborted"] >= 1, (alone, logs)  # the step the split hit: aborted, never applied
