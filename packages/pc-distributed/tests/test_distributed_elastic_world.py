"""ElasticDataParallel across processes under run_world: members killed, hung and joining mid-training.

Each test runs one local world (spawned ranks; run_world's launcher serves the store, so it outlives every
worker) with a grace period long enough for the survivors to finish after a rank dies. The survivors' final
parameters must equal a single-process replay of their recorded quorum log (float64, to 1e-12: only the
order of the all-reduce's sums differs), so a step applied twice, half, or with a wrong average fails.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest
import torch
from distributed_elastic_testutils import elastic_worker, replay
from distributed_testutils import Children

import pc_distributed as pd

pytestmark = [pytest.mark.slow, pytest.mark.backends_inside]

STEPS = 8


def _run(world_size: int, faults: dict[tuple[int, str], str], spawn_at: int | None = None) -> Any:
    return pd.run_world(
        elastic_worker,
        world_size,
        args=(STEPS, faults, spawn_at),
        timeout=170,
        grace_period=150,
        init_dist=False,
        init_rpc=False,
        dist_timeout=30,
    )


def _complete_log(results: list[dict[str, Any]]) -> list[tuple[int, tuple[str, ...]]]:
    """The members' quorum logs merged: they must agree on every step's members and cover every step."""
    steps: dict[int, tuple[str, ...]] = {}
    for r in results:
        for step, members in r["log"]:
            assert steps.setdefault(step, members) == members, (r["name"], step, members, steps[step])
    assert sorted(steps) == list(range(STEPS)), steps
    return sorted(steps.items())


def _assert_equal_to_replay(results: list[dict[str, Any]], log: list[tuple[int, tuple[str, ...]]]) -> None:
    expected = replay(log)
    for r in results:
        for got, want in zip(r["params"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=f"member {r['name']}")


def _survivors(error: BaseException) -> list[dict[str, Any]]:
    results: dict[int, Any] = error.run_world_results  # type: ignore[attr-defined]
    return [results[r] for r in sorted(results)]


def test_a_worker_killed_inside_a_step_and_two_failures_in_a_row() -> None:
    kids = Children()
    # Member "3" is SIGKILLed inside step 2 (after the quorum formed, before its all-reduce), member "2"
    # inside the re-run of step 2 or a later step it trains: two failures in a row. The others go on.
    faults = {(2, "3"): "kill", (2, "2"): "kill", (3, "2"): "kill"}
    with pytest.raises(pd.RankDiedError) as info:
        _run(4, faults)
    assert info.value.exitcode == -signal.SIGKILL
    survivors = _survivors(info.value)
    assert [r["name"] for r in survivors] == ["0", "1"]
    log = _complete_log(survivors)
    assert all(set(m) == {"0", "1"} for s, m in log if s > 2), log  # the dead never train again
    assert all(r["aborted"] >= 1 for r in survivors)  # the step each died in was aborted, then re-run
    _assert_equal_to_replay(survivors, log)
    assert kids.new() == []


def test_a_hung_worker_is_treated_as_dead_and_rejoins_when_resumed() -> None:
    kids = Children()
    # Member "2" stops (SIGSTOP) inside step 3: the others' reduction fails or times out (collective_timeout),
    # the attempt is aborted, its heartbeat is silent, so the next quorums leave it out. Member "0" resumes
    # it (SIGCONT) in step 5: it finds its attempt aborted, is behind, and re-enters with the state.
    results = _run(3, {(3, "2"): "stop"})
    log = _complete_log(results)
    resumed = results[2]["log"]
    assert any("2" not in m for s, m in log if s in (3, 4)), log  # trained without it while it was stopped
    assert resumed[-1] == (STEPS - 1, ("0", "1", "2"))  # back in by the end
    assert sum(r["aborted"] for r in results) >= 1
    _assert_equal_to_replay(results, log)
    assert kids.new() == []


def test_a_new_process_joins_mid_training_and_ends_equal() -> None:
    kids = Children()
    # Member "0" starts a brand-new process (member "new") in step 2; it registers, enters at a step boundary,
    # receives the model, the optimizer's momentum and the step count from a live member, and trains on.
    results = _run(2, {}, spawn_at=2)
    joined = results[0]["joiner"]
    assert results[0]["joiner_exitcode"] == 0
    everyone = [*results, joined]
    log = _complete_log(everyone)
    assert joined["log"]
    assert joined["log"][0][0] > 2  # it entered mid-training
    assert all("new" in m for s, m in log if s >= joined["log"][0][0])
    _assert_equal_to_replay(everyone, log)
    assert kids.new() == []
