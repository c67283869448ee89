"""Every way a user's script starts a World, each in separate processes, on both RPC backends.

Each form runs the script below the way a user would: ``python script.py`` once per rank (explicit
``tcp://`` URLs as machin's users write them, with and without a separate ``rpc_init_method``; ``env://``;
``file://``; ``MASTER_ADDR``/``MASTER_PORT``; a one-process World on an explicit URL), under torchrun (static
and c10d rendezvous), or through ``run_world``. Every rank builds its World, calls its neighbour over RPC,
all-reduces over a collective group and stops. Members whose settings differ (RPC backend, ``init_rpc``,
``init_dist``, names) get one ``ValueError`` naming each member's value, on every rank, long before
``dist_timeout``.

The processes run in sessions of their own and are killed at the end, whatever happened; their output goes to
files (a full pipe would block a rank).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.backends_inside

BACKENDS = ["tensorpipe", "c10d"]
# Seconds every run of the forms gets (a start costs seconds; far below pytest's per-test timeout).
RUN_TIMEOUT = 120.0

_SCRIPT = '''
import json
import os
import sys

import torch

import pc_distributed as pd


def exchange(world):
    """Call the neighbour (it answers with its name), all-reduce rank + 1 over every rank; one result line."""
    members = sorted(world.get_members())
    group = world.create_rpc_group("forms", members)
    peer = members[(members.index(world.name) + 1) % len(members)]
    answer = group.rpc_sync(peer, pd.get_cur_name)
    collective = world.create_collective_group(world.get_ranks())
    total = torch.tensor([float(world.rank + 1)])
    collective.all_reduce(total)
    group.destroy()
    return (
        f"RESULT {world.name} rank={world.rank}/{world.world_size} backend={world.rpc_backend} "
        f"rpc={answer} sum={total.item():g}"
    )


def in_run_world(rank):
    return exchange(pd.get_world())


def main():
    if sys.argv[1] == "run_world":
        for line in pd.run_world(in_run_world, 2, timeout=100, dist_timeout=60, rpc_timeout=60):
            print(line, flush=True)
        return
    kwargs = json.loads(sys.argv[1])
    name = kwargs.pop("name", None) or "w" + os.environ["RANK"]
    world = pd.World(name=name, **{"dist_timeout": 60, "rpc_timeout": 60, **kwargs})
    try:
        print(exchange(world), flush=True)
    finally:
        world.stop()


if __name__ == "__main__":
    main()
'''

_RESULT = re.compile(r"RESULT \w+ rank=\d+/\d+ backend=\w+ rpc=\w+ sum=\d+")

# What a user's shell hands the script: no rendezvous variables of the test runner's own.
_RDZV_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PC_RPC_BACKEND")


def _free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free a moment ago (bound to port 0 together, then released)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


def _base_env(backend: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in _RDZV_VARIABLES and not k.startswith("TORCHELASTIC_")
    }
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    env["PC_RPC_BACKEND"] = backend
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(tmp: Path, runs: list[tuple[list[str], list[str], dict[str, str]]]) -> list[tuple[int, str]]:
    """Start every ``(command, script arguments, env)`` at once and wait for all within ``RUN_TIMEOUT``.

    Returns each process's exit code and output (stdout and stderr). Every process, and whatever it started,
    is killed at the end; a run past the timeout fails the test with the outputs so far.
    """
    script = tmp / "user_script.py"
    script.write_text(_SCRIPT)
    procs: list[subprocess.Popen[bytes]] = []
    logs = [tmp / f"process-{i}.log" for i in range(len(runs))]
    try:
        for (command, script_args, env), log in zip(runs, logs, strict=True):
            with log.open("wb") as out:
                procs.append(
                    subprocess.Popen(
                        [*command, str(script), *script_args],
                        cwd=tmp,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + RUN_TIMEOUT
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                texts = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
                pytest.fail(f"not every process finished within {RUN_TIMEOUT:g} s\n{texts}")
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(
                    proc.pid, signal.SIGKILL
                )  # the process and anything it started (torchrun's workers)
            proc.wait(timeout=30)
    return [(proc.returncode, log.read_text()) for proc, log in zip(procs, logs, strict=True)]


def _script_ranks(
    tmp: Path, backend: str, per_rank: list[dict[str, Any]], envs: list[dict[str, str]] | None = None
) -> list[tuple[int, str]]:
    """Run ``python user_script.py KWARGS`` once per rank (``per_rank[r]``: rank r's World arguments)."""
    envs = envs or [{} for _ in per_rank]
    runs = [
        ([sys.executable], [json.dumps(kwargs)], {**_base_env(backend), **env})
        for kwargs, env in zip(per_rank, envs, strict=True)
    ]
    return _run(tmp, runs)


def _expected(backend: str, names: list[str]) -> list[str]:
    size = len(names)
    total = size * (size + 1) // 2
    return [
        f"RESULT {names[r]} rank={r}/{size} backend={backend} rpc={names[(r + 1) % size]} sum={total}"
        for r in range(size)
    ]


def _results(outputs: list[tuple[int, str]]) -> list[str]:
    for code, text in outputs:
        assert code == 0, text[-4000:]
    # torchrun's workers share one output: a line and its newline may reach it apart (interleaved)
    return sorted(line for _, text in outputs for line in _RESULT.findall(text))


def _plain(form: str, tmp: Path, ports: list[int]) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Each rank's World arguments and environment in a form started with ``python user_script.py``."""
    tcp = f"tcp://127.0.0.1:{ports[0]}"
    explicit = [{"name": f"w{r}", "rank": r, "world_size": 2} for r in range(2)]
    no_env: list[dict[str, str]] = [{}, {}]
    master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ports[0])}
    if form == "tcp":  # machin's form, one URL
        return [{**kw, "dist_init_method": tcp} for kw in explicit], no_env
    if form == "tcp+rpc":  # machin's defaults: a URL for each
        rpc = f"tcp://127.0.0.1:{ports[1]}"
        return [{**kw, "dist_init_method": tcp, "rpc_init_method": rpc} for kw in explicit], no_env
    if form == "tcp-query":  # torch's form: rank and size in the URL
        return [
            {"name": f"w{r}", "dist_init_method": f"{tcp}?rank={r}&world_size=2"} for r in range(2)
        ], no_env
    if form == "env":
        return [{**kw, "dist_init_method": "env://"} for kw in explicit], [master, master]
    if form == "file":
        return [{**kw, "dist_init_method": f"file://{tmp / 'rendezvous'}"} for kw in explicit], no_env
    if form == "master":  # torchrun's variables, set by hand
        return [{}, {}], [{**master, "RANK": str(r), "WORLD_SIZE": "2"} for r in range(2)]
    raise AssertionError(form)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["tcp", "tcp+rpc", "tcp-query", "env", "file", "master"])
def test_a_world_of_plain_processes_starts_in_every_form(form: str, backend: str, tmp_path: Path) -> None:
    per_rank, envs = _plain(form, tmp_path, _free_ports(2))
    assert _results(_script_ranks(tmp_path, backend, per_rank, envs)) == _expected(backend, ["w0", "w1"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_one_process_world_on_an_explicit_url(backend: str, tmp_path: Path) -> None:
    (port,) = _free_ports(1)
    kwargs = {"name": "w0", "dist_init_method": f"tcp://127.0.0.1:{port}"}
    assert _results(_script_ranks(tmp_path, backend, [kwargs])) == _expected(backend, ["w0"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rdzv", ["static", "c10d", "static+rpc"])
def test_a_world_under_torchrun(rdzv: str, backend: str, tmp_path: Path) -> None:
    port, rpc_port = _free_ports(2)
    if rdzv.startswith("static"):
        rendezvous = ["--rdzv_backend", "static", "--master_addr", "127.0.0.1", "--master_port", str(port)]
    else:
        rendezvous = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "forms"]
    # static+rpc: an address of RPC's own beside the agent's store (no agent serves it: rank 0 does)
    kwargs = {"rpc_init_method": f"tcp://127.0.0.1:{rpc_port}"} if rdzv.endswith("+rpc") else {}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2"]
    outputs = _run(tmp_path, [([*torchrun, *rendezvous], [json.dumps(kwargs)], _base_env(backend))])
    assert _results(outputs) == _expected(backend, ["w0", "w1"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_world_through_run_world(backend: str, tmp_path: Path) -> None:
    outputs = _run(tmp_path, [([sys.executable], ["run_world"], _base_env(backend))])
    assert _results(outputs) == _expected(backend, ["0", "1"])


def _mismatch(tmp: Path, per_rank: list[dict[str, Any]]) -> list[str]:
    """Start two ranks at MASTER_ADDR/MASTER_PORT (``dist_timeout`` beyond the run's); return their errors."""
    (port,) = _free_ports(1)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    kwargs = [{"rank": r, "world_size": 2, "dist_timeout": 600, **own} for r, own in enumerate(per_rank)]
    errors = []
    for code, text in _script_ranks(tmp, "tensorpipe", kwargs, [env, env]):
        assert code != 0, text[-4000:]
        errors.append(text.strip().splitlines()[-1])
    return errors


@pytest.mark.parametrize(
    ("per_rank", "error"),
    [
        (
            [{"name": "w0", "rpc_backend": "c10d"}, {"name": "w1", "rpc_backend": "tensorpipe"}],
            "ValueError: members use different RPC backends: {'w0': 'c10d', 'w1': 'tensorpipe'}",
        ),
        (
            [{"name": "w0", "rpc_backend": "tensorpipe"}, {"name": "w1", "rpc_backend": "c10d"}],
            "ValueError: members use different RPC backends: {'w0': 'tensorpipe', 'w1': 'c10d'}",
        ),
        (
            [{"name": "w0", "init_rpc": False}, {"name": "w1"}],
            "ValueError: members use different RPC backends: {'w0': 'none (init_rpc=False)', "
            "'w1': 'tensorpipe'}",
        ),
        (
            [{"name": "w0", "init_dist": False}, {"name": "w1"}],
            "ValueError: members use different process-group backends: {'w0': 'none (init_dist=False)', "
            "'w1': 'gloo'}",
        ),
        (
            [{"name": "w"}, {"name": "w"}],
            "ValueError: member names must be unique, got ['w', 'w'] (by rank)",
        ),
    ],
    ids=["c10d-tensorpipe", "tensorpipe-c10d", "init_rpc", "init_dist", "names"],
)
def test_members_that_disagree_get_one_value_error_on_every_rank(
    per_rank: list[dict[str, Any]], error: str, tmp_path: Path
) -> None:
    # dist_timeout (600 s) is far beyond the run's bound: only a check before the backends start gets here.
    assert _mismatch(tmp_path, per_rank) == [error, error]
