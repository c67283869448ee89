"""pc-distributed on simulated hosts (network namespaces, 2 torchrun workers each): healthy, faults, restarts.

Each test starts one torchrun per host (multihost.py) running multihost_worker.py, and reads what every rank
observed from its JSON file. The healthy runs (2 hosts with torchrun's static rendezvous, 3 with c10d; one job
each, shared by four tests) check World, collectives, RPC, DataParallel, DASO and a pc-server gradient server
across the hosts. The fault tests inject the fault once every rank is warmed up, then let every rank call
across hosts and stop; each row of the fault matrix (docs/reliability.md) has a bound, asserted here only with
a generous margin (this machine is shared and noisy; the measured times are in the docs). The elastic tests
kill one host's workers under ``--max_restarts=1`` and check that the job resumes from its checkpoint. A last
test checks that docs/multihost.md shows the torchrun commands these tests run.

Needs root and ``ip netns`` (skipped otherwise, with the reason); run with ``nox -s multihost``.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import multihost_checks as checks
import multihost_worker as worker
import pytest
from integration_docs import ROOT, parse_blocks
from multihost import SimHosts, TorchrunJob, sweep_stale, torchrun_args, unavailable_reason, wait_for

from pc_distributed._bounded import WAIT_GRACE
from pc_distributed.world.world import STOP_STORE_MARGIN

_REASON = unavailable_reason()
pytestmark = [
    pytest.mark.multihost,
    pytest.mark.slow,
    pytest.mark.skipif(_REASON is not None, reason=f"multi-host tests: {_REASON}"),
    pytest.mark.timeout(300),
]

WORKER = str(Path(worker.__file__).resolve())
DOCS = ROOT / "docs"
HOSTS, PER_HOST = 2, 2
SIZE = HOSTS * PER_HOST
START = 150.0  # seconds for 2 torchruns x 2 workers to import torch and meet on 2 shared cores
MARGIN = 25.0  # added to every documented bound (noisy shared machines)
CALL_BOUND = worker.CALL + MARGIN
STOP_BOUND = worker.STOP + STOP_STORE_MARGIN + MARGIN
PAIR_BOUND = worker.DIST_TIMEOUT + MARGIN  # a short store request
# A barrier's arrival is short requests (dist_timeout), then its wait (its timeout + WAIT_GRACE).
BARRIER_BOUND = worker.DIST_TIMEOUT + worker.CALL + WAIT_GRACE + MARGIN
RESULTS = 2 * CALL_BOUND + PAIR_BOUND + BARRIER_BOUND + STOP_BOUND  # the whole faulted sequence


@pytest.fixture
def hosts() -> Iterator[SimHosts]:
    with SimHosts(HOSTS) as made:
        yield made


def test_namespaces_of_a_killed_run_are_swept_and_a_live_runs_are_kept() -> None:
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    dead, live, other = f"pcmh{pid_max + 1}-beef-h0", f"pcmh{os.getpid()}-beef-h0", "pcmhtest-other"
    made = []
    try:
        for name in (dead, live, other):
            subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=30)
            made.append(name)
        swept = sweep_stale()
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        names = {line.split(" ", 1)[0] for line in listed.splitlines()}
        assert dead in swept
        assert dead not in names
        assert live not in swept
        assert live in names
        assert other not in swept
        assert other in names
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)


def _results(out: Path, ranks: list[int], key: str, job: TorchrunJob, timeout: float) -> dict[int, Any]:
    files = {r: out / f"rank{r}.json" for r in ranks}

    def reported() -> bool:
        return all(f.exists() and key in json.loads(f.read_text()) for f in files.values())

    def complete() -> bool:
        if reported():
            return True
        if all(p.poll() is not None for p in job.procs) and not reported():  # nothing more will come
            raise AssertionError(f"torchrun exited before ranks {ranks} reported {key!r}\n{job.all_logs()}")
        return False

    try:
        wait_for(complete, timeout, f"ranks {ranks} to report {key!r}")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{job.all_logs()}") from None
    return {r: json.loads(f.read_text()) for r, f in files.items()}


@dataclass
class Healthy:
    """One healthy job's observations: every rank's JSON, by rank."""

    hosts: int
    rdzv: str
    addrs: list[str]
    obs: dict[int, Any]
    logs: str

    @property
    def size(self) -> int:
        return self.hosts * PER_HOST

    def ns(self, rank: int) -> int:
        """The namespace (simulated host) rank ``rank`` ran in."""
        return int(self.obs[rank]["env"]["PC_MH_HOST"])

    def check(self, rank: int, name: str) -> dict[str, Any]:
        got = self.obs[rank]["checks"].get(name)
        assert got is not None, f"rank {rank} did not run check {name}\n{self.logs}"
        assert "error" not in got, f"rank {rank}, check {name}: {got}\n{self.logs}"
        return got  # type: ignore[no-any-return]


# 2 hosts with torchrun's static rendezvous (--master_addr/--node_rank), 3 with the c10d rendezvous.
TOPOLOGIES = [(2, "static"), (3, "c10d")]


@pytest.fixture(scope="module", params=TOPOLOGIES, ids=[f"{n}hosts-{r}" for n, r in TOPOLOGIES])
def healthy(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Healthy:
    """Run the ``basic`` scenario (World, collectives, RPC, then the training checks) once per topology."""
    n, rdzv = request.param
    out = tmp_path_factory.mktemp(f"healthy{n}{rdzv}")
    with SimHosts(n) as sim:
        script = [WORKER, "basic", str(out), ",".join(checks.CHECKS)]
        job = TorchrunJob(sim, script, out, nproc_per_node=PER_HOST, rdzv=rdzv)
        obs = _results(out, list(range(n * PER_HOST)), "stop_s", job, START + 60 * n)
        for name in checks.CHECKS:
            took = max(o["checks"].get(name, {}).get("seconds", float("nan")) for o in obs.values())
            print(f"[multihost] {n} hosts ({rdzv}): check {name} took {took:.2f}s")
        codes = job.wait(60)
        assert codes == [0] * n, job.all_logs()
        return Healthy(n, rdzv, [sim.addr(i) for i in range(n)], obs, job.all_logs())


def test_world_collectives_and_rpc_across_hosts(healthy: Healthy) -> None:
    size, obs = healthy.size, healthy.obs
    for rank, o in obs.items():
        host, local = divmod(rank, PER_HOST)
        group_zero_ns = healthy.ns(0)
        assert o["env"] == {
            "RANK": str(rank),
            "WORLD_SIZE": str(size),
            "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(PER_HOST),
            "GROUP_RANK": str(host),
            "ROLE_RANK": str(rank),
            "MASTER_ADDR": healthy.addrs[group_zero_ns],
            "TORCHELASTIC_RESTART_COUNT": "0",
            "PC_MH_HOST": o["env"]["PC_MH_HOST"],
        }, healthy.logs
        if healthy.rdzv == "static":
            assert healthy.ns(rank) == host  # --node_rank orders the hosts
        assert healthy.ns(rank) == healthy.ns(host * PER_HOST)  # a node's ranks share its host
        assert (o["rank"], o["world_size"]) == (rank, size)
        assert o["members"] == o["name_of"] == [f"w{r}" for r in range(size)]
        assert o["all_reduce"] == sum(range(1, size + 1))
        assert o["all_gather"] == [float(r) for r in range(size)]
        assert ("cross_all_reduce" in o) == (rank in (PER_HOST - 1, PER_HOST))
        peer = (rank + PER_HOST) % size
        assert healthy.ns(peer) != healthy.ns(rank)
        assert o["rpc_sync"] == f"hi@host{peer // PER_HOST}:rank{peer}:ns{healthy.ns(peer)}"  # the other host
        assert o["get_paired"] == {"from": peer}
        assert o["registered_sync"] == rank
    # every simulated host ran one node
    assert sorted({healthy.ns(r) for r in obs}) == list(range(healthy.hosts))
    assert obs[1]["cross_all_reduce"] == obs[2]["cross_all_reduce"] == 10.0 * (1 + 2)


def test_data_parallel_across_hosts_equals_single_process_sgd(healthy: Healthy) -> None:
    for rank in healthy.obs:
        errs = healthy.check(rank, "data_parallel")
        assert errs["blocking"] < 1e-6, errs
        assert errs["nonblocking"] < 1e-6, errs


def test_daso_nodes_are_the_hosts(healthy: Healthy) -> None:
    first = healthy.check(0, "daso")
    assert first["phases"][0] == [0, 0, 0]  # warm-up: blocking
    assert first["phases"][1][0] == 2  # cycling: global exchanges every max_global_skips batches
    assert first["phases"][-1] == [0, 0, 0]  # cool-down
    assert first["losses"][-1] < first["losses"][0], first["losses"]
    for rank in healthy.obs:
        got = healthy.check(rank, "daso")
        host, local = divmod(rank, PER_HOST)
        # node and local rank from torchrun's GROUP_RANK / LOCAL_RANK; nothing simulated
        assert got["topology"] == [host, local, PER_HOST, healthy.hosts], got
        assert got["local_group_hosts"] == [host] * PER_HOST  # a node-local group is one host's ranks
        assert got["column_group_hosts"] == list(range(healthy.hosts))  # the global exchange spans the hosts
        assert got["agree"] == [True] * len(got["phases"]), "ranks differ after an epoch"
        assert got["phases"] == first["phases"]


def test_grad_server_primary_on_one_host_clients_on_the_others(healthy: Healthy) -> None:
    clients = list(range(PER_HOST, healthy.size))  # every rank off host 0
    primary = healthy.check(0, "grad_server")
    assert primary["role"] == ["primary"]
    assert healthy.check(1, "grad_server")["role"] == ["secondary"]
    assert healthy.check(PER_HOST, "grad_server")["role"] == ["secondary", "client"]
    expected = checks.expected_server_weights(clients)
    assert primary["weights"] == expected  # integer gradients, SGD lr 1, sum: exactly minus what was applied
    assert primary["balanced"], primary
    total = primary["ledger_total"]
    pushes = checks.SERVER_PUSHES * len(clients)
    assert (total["accepted"], total["applied"], total["refused_stale"]) == (pushes, pushes, 0), total
    assert sum(v for k, v in total.items() if k.startswith("dropped")) == 0, total
    for rank in clients:
        got = healthy.check(rank, "grad_server")
        assert got["accepted"] == checks.SERVER_PUSHES
        assert primary["ledger_clients"][got["client_id"]]["applied"] == checks.SERVER_PUSHES
        assert got["pulled"] == expected  # the final model, pulled from host 0
    assert len(primary["ledger_clients"]) == len(clients)


def _fault_job(hosts: SimHosts, out: Path, scenario: str = "fault") -> TorchrunJob:
    job = TorchrunJob(hosts, [WORKER, scenario, str(out)], out, nproc_per_node=PER_HOST)
    try:
        wait_for(lambda: all((out / f"ready{r}").exists() for r in range(SIZE)), START, "every rank ready")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{job.all_logs()}") from None
    return job


def _report(row: str, obs: dict[int, Any]) -> None:
    """Print the measured times (``pytest -s``; docs/reliability.md's matrix is made from these lines)."""
    for rank, o in sorted(obs.items()):
        times = {
            k: f"{o[k]['s']:.2f}s {'ok' if o[k]['ok'] else o[k]['error']}"
            for k in ("rpc_sync", "all_reduce", "pair", "barrier", "stop")
        }
        print(f"[multihost] {row} rank {rank}: {times}")


def _check_raised_and_stopped(row: str, obs: dict[int, Any], job: TorchrunJob) -> None:
    _report(row, obs)
    for rank, o in obs.items():
        why = f"rank {rank}: {o}\n{job.all_logs()}"
        assert not o["rpc_sync"]["ok"], why
        assert o["rpc_sync"]["error"] in ("TimeoutError", "ConnectionError"), why
        assert o["rpc_sync"]["s"] < CALL_BOUND, why
        assert not o["all_reduce"]["ok"], why
        assert o["all_reduce"]["error"] in ("RuntimeError", "TimeoutError"), why
        assert o["all_reduce"]["s"] < CALL_BOUND, why
        assert o["pair"]["s"] < PAIR_BOUND, why  # succeeds where the store answers, else raises
        assert not o["barrier"]["ok"], why  # the other host's members never arrive
        assert o["barrier"]["s"] < BARRIER_BOUND, why
        assert o["stop"]["ok"], why
        assert o["stop"]["s"] < STOP_BOUND, why


def test_partition_every_rank_raises_and_stops_on_both_sides(hosts: SimHosts, tmp_path: Path) -> None:
    job = _fault_job(hosts, tmp_path)
    hosts.cut(1)
    (tmp_path / "go").write_text("1")
    limit = RESULTS
    obs = _results(tmp_path, list(range(SIZE)), "stop", job, limit)
    _check_raised_and_stopped("partition", obs, job)
    for rank in range(SIZE):
        assert obs[rank]["pair"]["ok"] == (rank < PER_HOST), obs[rank]  # only the store's host reaches it


@pytest.mark.parametrize("lost", [1, 0], ids=["worker-host", "store-host"])
def test_lost_host_survivors_raise_and_stop(hosts: SimHosts, tmp_path: Path, lost: int) -> None:
    job = _fault_job(hosts, tmp_path)
    hosts.kill_host(lost)
    (tmp_path / "go").write_text("1")
    survivors = [r for r in range(SIZE) if r // PER_HOST != lost]
    limit = RESULTS
    _check_raised_and_stopped(f"lost host {lost}", _results(tmp_path, survivors, "stop", job, limit), job)


def test_frozen_store_host_times_out_without_hanging(hosts: SimHosts, tmp_path: Path) -> None:
    job = _fault_job(hosts, tmp_path)
    hosts.freeze(0)  # the store's host: its sockets stay open, nothing answers
    (tmp_path / "go").write_text("1")
    survivors = [r for r in range(SIZE) if r // PER_HOST != 0]
    limit = RESULTS
    obs = _results(tmp_path, survivors, "stop", job, limit)
    _check_raised_and_stopped("frozen store host", obs, job)
    for o in obs.values():
        assert o["rpc_sync"]["error"] == "TimeoutError", o  # a frozen peer is silent, not refused
        assert o["pair"]["error"] == "TimeoutError", o  # the store never answers: bounded, not a hang


def test_partition_healed_before_the_timeout_lets_the_job_continue(hosts: SimHosts, tmp_path: Path) -> None:
    job = _fault_job(hosts, tmp_path, "heal")
    hosts.cut(1)
    (tmp_path / "go").write_text("1")
    # Every rank has started its cross-host calls while the link is down; then the cable goes back in.
    wait_for(lambda: all((tmp_path / f"calling{r}").exists() for r in range(SIZE)), 60, "every rank calling")
    hosts.heal(1)
    obs = _results(tmp_path, list(range(SIZE)), "stop", job, worker.HEAL_CALL + STOP_BOUND + MARGIN)
    _report("partition healed", obs)
    for rank, o in obs.items():
        peer = (rank + PER_HOST) % SIZE
        assert o["rpc_sync"] == {
            **o["rpc_sync"],
            "ok": True,
            "result": repr(f"fault@host{1 - rank // PER_HOST}:rank{peer}:ns{1 - rank // PER_HOST}"),
        }, o
        assert o["all_reduce"]["ok"], o
        assert o["all_reduce_value"] == SIZE, o
        assert o["pair"]["ok"], o
        assert o["barrier"]["ok"], o
        assert o["stop"]["ok"], o


@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_elastic_restart_resumes_from_the_checkpoint(hosts: SimHosts, tmp_path: Path, rdzv: str) -> None:
    """``torchrun --max_restarts=1``: host 1's workers SIGKILLed after the checkpoint;
    the job restarts, resumes from it, and ends where an uninterrupted run ends.

    With c10d, torchrun's shared store is turned off (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): each attempt
    then gets a new store, served by its rank 0. With the shared store the healthy host's agent restarts its
    workers for the membership change without counting a restart, so the hosts' ``TORCHELASTIC_RESTART_COUNT``
    differ and World (which scopes its keys in an agent's store by it) cannot meet (docs/multihost.md).
    """
    script = [WORKER, "elastic", str(tmp_path)]
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if rdzv == "c10d" else {}
    job = TorchrunJob(
        hosts, script, tmp_path, nproc_per_node=PER_HOST, max_restarts=1, rdzv=rdzv, extra_env=env
    )
    try:
        wait_for(
            lambda: all((tmp_path / f"checkpointed{r}").exists() for r in range(SIZE)),
            START,
            "the checkpoint",
        )
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{job.all_logs()}") from None
    assert (tmp_path / "ckpt.pt").exists()
    t_kill = time.time()  # compared with the workers' time.time() (one machine, one clock); printed only
    killed = job.kill_workers(1)  # the event: every rank has written its marker after the checkpoint
    assert len(killed) == PER_HOST, killed
    (tmp_path / "go").write_text("1")  # host 0's workers go on, find their peers dead and fail
    obs = _results(tmp_path, list(range(SIZE)), "done", job, START + 120)
    assert job.wait(120) == [0] * HOSTS, job.all_logs()
    resumed = max(o["t_resumed"] for o in obs.values()) - t_kill
    done = max(o["t_done"] for o in obs.values()) - t_kill
    print(f"[multihost] elastic restart: every rank resumed {resumed:.2f}s after the kill, done {done:.2f}s")
    expected = checks.elastic_oracle(SIZE)
    for rank, o in obs.items():
        # the restarted workers finished the job, resuming from the checkpoint (a fresh process: no wait)
        assert o["start"] == checks.ELASTIC_CHECKPOINT, (o, job.all_logs())
        # The killed host's agent counts a restart. Under c10d the other agents restart their workers for the
        # membership change without counting one (torch's rule), so only the static hosts all say 1.
        if rdzv == "static" or rank // PER_HOST == 1:
            assert o["attempt"] == 1, o
        err = max(
            abs(a - b)
            for got, ref in zip(o["params"], expected, strict=True)
            for a, b in zip(got, ref, strict=True)
        )
        assert err < 1e-6, (rank, err)  # = the uninterrupted run (single-process SGD over every step)


def _doc_commands() -> list[list[str]]:
    """Every ``torchrun`` command of docs/multihost.md's shell blocks, as argv (continuation lines joined)."""
    commands = []
    for block in parse_blocks(DOCS / "multihost.md"):
        if block.lang != "bash":
            continue
        for line in block.code.replace("\\\n", " ").splitlines():
            argv = shlex.split(line)
            if "torchrun" in argv:
                commands.append(argv)
    return commands


def test_the_guide_shows_the_commands_the_tests_run() -> None:
    """docs/multihost.md's torchrun lines are the harness's (its addresses 10.0.0.x, port 29500, id job1)."""
    elastic = {(HOSTS, "static", 1), (HOSTS, "c10d", 1)}
    topologies = {(n, rdzv, 0) for n, rdzv in TOPOLOGIES} | elastic  # the healthy runs and the restarts
    seen = set()
    for argv in _doc_commands():
        at = argv.index("torchrun")
        options, script = argv[at + 1 : -1], argv[-1]
        assert script == "train.py", argv
        flags = dict(o.removeprefix("--").split("=", 1) for o in options)
        n, restarts = int(flags["nnodes"]), int(flags["max_restarts"])
        rdzv = flags.get("rdzv_backend", "static")
        env = ["GLOO_SOCKET_IFNAME=eth0", "TP_SOCKET_IFNAME=eth0"]
        if rdzv == "c10d" and restarts:  # as the c10d restart test runs it
            env.append("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
        assert argv[:at] == env, argv
        addrs = [f"10.0.0.{j + 1}" for j in range(n)]
        i = int(flags["node_rank"]) if rdzv == "static" else addrs.index(flags["local_addr"])
        assert options == torchrun_args(addrs, i, PER_HOST, 29500, rdzv, restarts, run_id="job1"), argv
        seen.add((n, rdzv, restarts, i))
    assert seen == {(n, r, m, i) for n, r, m in topologies for i in range(n)}, "a host's command is missing"
