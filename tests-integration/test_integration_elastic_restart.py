"""A worker that torchrun restarts (``--max_restarts``) rejoins an elastic job and ends equal to the others.

Three torchrun agents run as separate processes on loopback, one worker each (``--nnodes 3
--nproc_per_node 1``), with the static rendezvous (``--node_rank``, ``--master_addr``, ``--master_port``):
node 0's agent serves the store, and an agent that restarts its worker does not make the other agents
restart theirs (the static rendezvous never reports nodes waiting), so their workers train on.

The worker of node 2 kills itself (SIGKILL) inside step :data:`KILL_STEP` in its first incarnation only.
Two marker files order what is otherwise a race, so that the test always sees both things it checks: the
restarted incarnation (``w2-1``) enlists only once the survivors committed a step without ``w2-0`` (``solo``),
and the survivors wait inside step :data:`HOLD_STEP`, if ``w2-1`` is not in its quorum yet, until it enlisted
(``joined``), so that it is in the job's last steps. Every member that finishes writes its final parameters
(``<name>.pt``) and its quorum log (``<name>.json``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

STEPS = 8
KILL_STEP = 3
HOLD_STEP = 5
AGENT_TIMEOUT = 240.0  # seconds all three agents together may run

WORKER = f'''
"""One elastic member under torchrun: ``python worker.py <out_dir>``."""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

import pc_distributed as pd

STEPS = {STEPS}
KILL_STEP = {KILL_STEP}
HOLD_STEP = {HOLD_STEP}
MARKER_WAIT = 120.0

OUT = Path(sys.argv[1])
SAMPLER = pd.ElasticSampler(num_samples=96, batch_size=12, seed=3)
_GEN = torch.Generator().manual_seed(11)
X = torch.randn(96, 5, dtype=torch.float64, generator=_GEN)
Y = torch.randn(96, 2, dtype=torch.float64, generator=_GEN)


def mark(label):
    tmp = OUT / f".{{label}}.{{os.getpid()}}"
    tmp.write_text("1")
    tmp.replace(OUT / label)


def wait_for(label):
    deadline = time.monotonic() + MARKER_WAIT
    while not (OUT / label).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no {{label}} marker in {{MARKER_WAIT:g}} s")
        time.sleep(0.05)


torch.set_num_threads(1)
node = int(os.environ["RANK"])
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
name = f"w{{node}}-{{restart}}"
torch.manual_seed(node)
model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
if restart != "0":
    wait_for("solo")  # the survivors committed a step without the killed incarnation
edp = pd.ElasticDataParallel(
    model,
    sgd,
    name=name,
    initial_members=int(os.environ["WORLD_SIZE"]),
    member_timeout=5.0,
    collective_timeout=20.0,
    store_timeout=20.0,
    quorum_timeout=60.0,
)
with edp:
    if restart != "0":
        mark("joined")

    def compute(ctx):
        if ctx.step == KILL_STEP and ctx.member == "w2-0":
            os.kill(os.getpid(), signal.SIGKILL)  # dies inside the step, after the quorum formed
        if ctx.step == HOLD_STEP and "w2-1" not in ctx.members:
            wait_for("joined")  # the restarted member is enlisted: it is in the next quorum
        idx = SAMPLER.indices(ctx.step, ctx.members, ctx.member)
        torch.nn.functional.mse_loss(model(X[idx]), Y[idx]).backward()
        return len(idx)

    while edp.step < STEPS:
        entry = edp.train_step(compute)
        if "w2-0" not in entry.members and "w2-1" not in entry.members:
            mark("solo")
    torch.save([p.detach().clone() for p in model.parameters()], OUT / f"{{name}}.pt")
    log = [[e.step, list(e.members)] for e in edp.quorum_log]
    (OUT / f"{{name}}.json").write_text(json.dumps({{"name": name, "step": edp.step, "log": log}}))
print(f"{{name}}: {{STEPS}} steps", flush=True)
'''


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _agent_command(node: int, port: int, script: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "3",
        "--nproc_per_node",
        "1",
        "--node_rank",
        str(node),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        "--max_restarts",
        "1",
        str(script),
        str(script.parent),
    ]


def _outputs(tmp_path: Path) -> str:
    parts = []
    for node in range(3):
        for stream in ("out", "err"):
            path = tmp_path / f"agent{node}.{stream}"
            text = path.read_text(errors="replace") if path.exists() else "(none)"
            parts.append(f"--- agent {node} std{stream}\n{text[-6000:]}")
    return "\n".join(parts)


def _workers(script: Path) -> list[psutil.Process]:
    """The live workers running ``script``, not the agents (each worker has a session of its own)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if str(script) in cmdline and "torch.distributed.run" not in cmdline:
            found.append(proc)
    return found


def _run_agents(tmp_path: Path) -> tuple[list[int], list[str]]:
    """Start the three agents, wait for all of them (bounded); return their exit codes and any stray workers.

    Whatever happens, every agent's process group is killed, and then every worker still running the
    script: torchrun starts its workers in sessions of their own, which an agent killed with SIGKILL leaves
    behind. A worker still running after all three agents exited is a stray, returned for the test to fail on.
    """
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = _free_port()
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["OMP_NUM_THREADS"] = "1"
    procs: list[subprocess.Popen[bytes]] = []
    strays: list[str] = []
    try:
        for node in range(3):
            with (
                (tmp_path / f"agent{node}.out").open("wb") as out,
                (tmp_path / f"agent{node}.err").open("wb") as err,
            ):
                procs.append(
                    subprocess.Popen(
                        _agent_command(node, port, script),
                        cwd=tmp_path,
                        env=env,
                        stdout=out,
                        stderr=err,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + AGENT_TIMEOUT
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pytest.fail(f"the agents ran longer than {AGENT_TIMEOUT:g} s\n{_outputs(tmp_path)}")
        strays = [" ".join(p.info["cmdline"] or []) for p in _workers(script)]
        return codes, strays
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        left = _workers(script)
        for worker in left:
            with contextlib.suppress(psutil.Error):
                worker.kill()
        psutil.wait_procs(left, timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_worker_restarted_by_torchrun_rejoins_and_ends_equal(tmp_path: Path) -> None:
    codes, strays = _run_agents(tmp_path)
    outputs = _outputs(tmp_path)
    assert codes == [0, 0, 0], f"agents' exit codes {codes}\n{outputs}"
    assert strays == [], f"workers left running after their agents exited: {strays}"

    # The restart happened: node 2's first incarnation left nothing, its second finished; no other restart.
    finished = sorted(p.stem for p in tmp_path.glob("w*.json"))
    assert finished == ["w0-0", "w1-0", "w2-1"], f"{finished}\n{outputs}"
    assert f"w2-1: {STEPS} steps" in (tmp_path / "agent2.out").read_text(), outputs

    logs = {}
    for name in finished:
        report = json.loads((tmp_path / f"{name}.json").read_text())
        assert report["step"] == STEPS, (name, report)
        logs[name] = [(step, tuple(members)) for step, members in report["log"]]

    full = ("w0-0", "w1-0", "w2-0")
    survivors = ("w0-0", "w1-0")
    rejoined = ("w0-0", "w1-0", "w2-1")
    log = logs["w0-0"]
    assert logs["w1-0"] == log, logs
    assert [step for step, _ in log] == list(range(STEPS)), log
    # Before the kill all three; the killed step re-run without node 2; from a step on, the restarted member.
    assert log[:KILL_STEP] == [(s, full) for s in range(KILL_STEP)], log
    assert log[KILL_STEP] == (KILL_STEP, survivors), log
    first = next(step for step, members in log if members == rejoined)
    assert KILL_STEP < first <= HOLD_STEP + 1, log
    assert log[KILL_STEP:first] == [(s, survivors) for s in range(KILL_STEP, first)], log
    assert log[first:] == [(s, rejoined) for s in range(first, STEPS)], log
    # The restarted member committed exactly the steps it was in: it got the rest with the state.
    assert logs["w2-1"] == log[first:], logs

    params = {name: torch.load(tmp_path / f"{name}.pt") for name in finished}
    for name in ("w1-0", "w2-1"):
        assert len(params[name]) == len(params["w0-0"])
        for mine, theirs in zip(params[name], params["w0-0"], strict=True):
            assert mine.dtype == torch.float64
            assert torch.equal(mine, theirs), (name, mine, theirs)
