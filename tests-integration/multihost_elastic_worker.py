"""The elastic member that test_integration_elastic_multihost.py starts under torchrun on each simulated host.

``python multihost_elastic_worker.py <out_dir> <min_members> <quorum_timeout>``, one worker per host
(``--nproc_per_node=1``): the member named ``h<i>`` for host ``i`` (``PC_MH_HOST``) trains :data:`STEPS`
steps of ``ElasticDataParallel`` on the store of torchrun's agent (host 0's). Inside step :data:`HOLD` (in
``compute``, after the quorum formed, before the all-reduce) it writes ``<out_dir>/held<i>`` and waits for the
test to write ``<out_dir>/go`` after it injected the fault (a host cut off, a partition). It then trains on,
or raises; either way it writes what it observed to ``<out_dir>/member<i>.json`` (the quorum log, the final
parameters, the error it raised and when) and leaves at once (``os._exit``: torch's exit handlers could wait
on lost peers).

With ``PC_MH_ETCD`` set (the client URLs of an etcd member on each host, by host), the member's store is an
:class:`~pc_distributed.EtcdStore` on that cluster, its own host's member first, instead of the agent's store.

Times are ``time.time()`` (one machine, one clock: comparable with the test's), reported, never checked here.
The model, the data and the replay of a quorum log are the package tests' (``distributed_elastic_testutils``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pc_distributed import ElasticDataParallel, EtcdStore, StepContext

# The model, the data and the replay are the elastic package tests' (one definition for both suites).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "pc-distributed" / "tests"))
import distributed_elastic_testutils as elastic

STEPS = 8
HOLD = 3  # the step inside which every member waits for the test's fault
HEARTBEAT = 0.5
MEMBER_TIMEOUT = 5.0
COLLECTIVE_TIMEOUT = 5.0
STORE_TIMEOUT = 5.0
GO_WAIT = 120.0  # seconds a held member waits for the test's ``go``


def replay(log: Sequence[tuple[int, Sequence[str]]]) -> list[list[float]]:
    """The package tests' single-process replay of a complete quorum log, as :func:`flat_params` gives it."""
    return [p.reshape(-1).tolist() for p in elastic.replay(log)]


def flat_params(model: torch.nn.Module) -> list[list[float]]:
    """The parameters and buffers, as the package tests' replay gives them, as lists of numbers (JSON)."""
    return [t.reshape(-1).tolist() for t in elastic.params(model)]


def _write(out: Path, host: int, obs: dict[str, Any]) -> None:
    tmp = out / f".member{host}.json"
    tmp.write_text(json.dumps(obs))
    tmp.replace(out / f"member{host}.json")


def _hold(out: Path, host: int) -> None:
    (out / f"held{host}").write_text("1")
    deadline = time.monotonic() + GO_WAIT
    while not (out / "go").exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no go from the test in {GO_WAIT:g} s")
        time.sleep(0.05)


def main() -> None:
    out, min_members, quorum_timeout = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    torch.set_num_threads(1)
    host = int(os.environ["PC_MH_HOST"])
    name = f"h{host}"
    model = elastic.make_model(name)
    obs: dict[str, Any] = {"name": name, "log": [], "aborted": 0}
    edp = None
    store = None
    if os.environ.get("PC_MH_ETCD"):
        urls = os.environ["PC_MH_ETCD"].split(",")
        store = EtcdStore(urls[host:] + urls[:host], prefix="mh/", timeout=STORE_TIMEOUT)
    try:
        edp = ElasticDataParallel(
            model,
            elastic.make_optimizer(model),
            name=name,
            store=store,
            job="mh",
            min_members=min_members,
            initial_members=int(os.environ["WORLD_SIZE"]),
            heartbeat_period=HEARTBEAT,
            member_timeout=MEMBER_TIMEOUT,
            collective_timeout=COLLECTIVE_TIMEOUT,
            store_timeout=STORE_TIMEOUT,
            quorum_timeout=quorum_timeout,
        )
        held = False

        def compute(ctx: StepContext) -> int:
            nonlocal held
            if ctx.step == HOLD and not held:
                held = True
                _hold(out, host)
            return elastic.shard_loss(model, ctx)

        while edp.step < STEPS:
            entry = edp.train_step(compute)
            if entry.step == HOLD:
                obs["t_hold_committed"] = time.time()
        obs["t_done"] = time.time()
    except Exception as exc:  # what the test checks: a clear error, not a hang
        obs["error"] = {"type": type(exc).__name__, "message": str(exc)[:500], "t": time.time()}
    if edp is not None:
        obs["log"] = [[e.step, list(e.members)] for e in edp.quorum_log]
        obs["aborted"] = edp.aborted_attempts
        start = time.monotonic()
        edp.close()
        obs["close_s"] = time.monotonic() - start
    obs["params"] = flat_params(model)
    _write(out, host, obs)
    sys.stdout.flush()
    os._exit(1 if "error" in obs else 0)  # at once: the groups of a lost peer must not hold the process


if __name__ == "__main__":
    main()
