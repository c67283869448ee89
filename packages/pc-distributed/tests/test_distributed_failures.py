"""Failure paths: a peer killed mid-collective and mid-RPC, stop() with a dead peer, run_world's errors.

The peer-death world is spawned; the launcher checks fork store-only Worlds (spawn once CUDA is initialized),
which start in well under a second.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from distributed_testutils import Children, fork_unless_cuda

import pc_distributed as pd


def slow_echo(seconds: float) -> str:
    threading.Event().wait(seconds)  # the peer is killed while serving this call
    return "finished"


def _peer_death(rank: int, out_dir: str) -> str:
    torch.set_num_threads(1)
    world = pd.get_world()
    assert world is not None
    group = world.create_rpc_group("g", ["0", "1", "2"])
    everyone = world.create_collective_group([0, 1, 2], timeout=10)
    fut = group.rpc_async("2", slow_echo, timeout=30, args=(25.0,)) if rank == 1 else None
    group.barrier(timeout=30)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    obs: dict[str, Any] = {}
    try:
        if rank == 0:
            everyone.all_reduce(torch.ones(4))  # rank 2 never joins: it is dead
        else:
            assert fut is not None
            obs["result"] = fut.wait()  # "finished" only if the 25 s call ran to its end
        obs["error"] = None
    except Exception as exc:
        obs["error"] = type(exc).__name__
    world.stop(timeout=3)  # if it hung, run_world would kill this rank after its grace period: no report
    obs["world_after_stop"] = pd.get_world()
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(obs))
    return "done"


def test_peer_killed_mid_collective_and_mid_rpc(tmp_path: Path) -> None:
    kids = Children()
    # Event order, no clock: rank 2 dies while serving rank 1's 25 s call and while rank 0 waits in an
    # all_reduce. Each survivor must see an error (not the call's result) and then return from stop(), which
    # the report files prove: a rank stuck in stop would be killed after the grace period without writing one.
    with pytest.raises(pd.RankDiedError) as info:
        pd.run_world(
            _peer_death,
            3,
            args=(str(tmp_path),),
            timeout=150,
            dist_timeout=10,
            rpc_timeout=10,
            grace_period=90,
        )
    assert info.value.rank == 2
    assert info.value.exitcode == -signal.SIGKILL
    assert "SIGKILL" in str(info.value)
    for rank in (0, 1):
        obs = pickle.loads(Path(tmp_path, f"rank{rank}.pkl").read_bytes())
        assert obs["error"] is not None, f"rank {rank} saw no error from the dead peer: {obs}"
        assert "result" not in obs, f"rank {rank} got the dead peer's result: {obs}"
        assert obs["world_after_stop"] is None
    assert info.value.run_world_results == {0: "done", 1: "done"}  # type: ignore[attr-defined]
    assert kids.new() == []


# -- run_world's own failure handling (fork, store-only worlds) ---
def _rank_times_ten(rank: int) -> int:
    return rank * 10


def _rank_one_raises(rank: int) -> int:
    if rank == 1:
        raise ValueError("boom from rank 1")
    return rank


def _rank_zero_exits(rank: int) -> int:
    if rank == 0:
        os._exit(7)
    threading.Event().wait(60)  # stays until killed after the grace period
    return rank


def _rank_zero_hangs(rank: int) -> int:
    if rank == 0:
        threading.Event().wait(120)
    return rank


_FAST = {"start_method": "fork", "init_dist": False, "init_rpc": False, "dist_timeout": 20}


def _tensor_result(rank: int) -> dict[str, torch.Tensor]:
    # Small tensors: a forked child must not enter an intra-op parallel region (OpenMP is not fork-safe).
    return {"t": torch.full((3,), float(rank)), "big": torch.arange(1000) + rank}


def _rank_one_killed(rank: int) -> int:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank * 10


def test_run_world_returns_results_by_rank() -> None:
    assert pd.run_world(_rank_times_ten, 3, timeout=60, **_FAST) == [0, 10, 20]


def test_run_world_returns_tensors_by_value() -> None:
    # Tensors come back even though the ranks have exited (no file-descriptor sharing with dead processes).
    out = pd.run_world(_tensor_result, 2, timeout=60, **_FAST)
    for rank, result in enumerate(out):
        assert torch.equal(result["t"], torch.full((3,), float(rank)))
        assert torch.equal(result["big"], torch.arange(1000) + rank)


def test_run_world_failure_carries_the_survivors_results() -> None:
    kids = Children()
    with pytest.raises(pd.RankDiedError, match="SIGKILL") as info:
        pd.run_world(_rank_one_killed, 3, timeout=60, **_FAST)
    assert info.value.rank == 1
    assert info.value.run_world_results == {0: 0, 2: 20}  # type: ignore[attr-defined]
    assert kids.new() == []


def test_run_world_reraises_the_original_type_naming_the_rank() -> None:
    with pytest.raises(ValueError, match="boom from rank 1") as info:
        pd.run_world(_rank_one_raises, 2, timeout=60, **_FAST)
    assert isinstance(info.value.__cause__, pd.RemoteTraceback)
    assert "_rank_one_raises" in info.value.__cause__.text
    if sys.version_info >= (3, 11):  # exception notes exist from Python 3.11 on
        assert any("rank 1" in note for note in getattr(info.value, "__notes__", []))


def test_an_error_does_not_hold_up_the_other_ranks_stop() -> None:
    # rank 0 finishes and stops gracefully; rank 1 raises and leaves non-gracefully. Rank 0's stop must not
    # wait for rank 1: had it waited, run_world would have killed it after the grace period, and its result
    # would be missing.
    with pytest.raises(ValueError, match="boom from rank 1") as info:
        pd.run_world(
            _rank_one_raises,
            2,
            timeout=150,
            start_method=fork_unless_cuda(),
            grace_period=90,
            dist_timeout=30,
            rpc_timeout=30,
        )
    assert info.value.run_world_results == {0: 0}  # type: ignore[attr-defined]


def test_run_world_reports_a_dead_rank_promptly() -> None:
    kids = Children()
    # RankDiedError, not run_world's TimeoutError (the 120 s deadline); rank 1 was killed after the 1 s grace
    # period rather than waited for (its 60 s wait would have returned a result).
    with pytest.raises(pd.RankDiedError, match="exited with code 7") as info:
        pd.run_world(_rank_zero_exits, 2, timeout=120, grace_period=1, **_FAST)
    assert (info.value.rank, info.value.exitcode) == (0, 7)
    assert info.value.run_world_results == {}  # type: ignore[attr-defined]
    assert "were killed after the failure of rank 0" in " ".join(getattr(info.value, "__notes__", []))
    assert kids.new() == []


def test_run_world_timeout_kills_and_names_the_running_ranks() -> None:
    kids = Children()
    with pytest.raises(TimeoutError, match=r"ranks still running: \[0\]"):
        pd.run_world(_rank_zero_hangs, 2, timeout=3, **_FAST)
    assert kids.new() == []


def test_run_world_bad_arguments() -> None:
    with pytest.raises(TypeError, match="picklable"):
        pd.run_world(lambda rank: rank, 2)
    with pytest.raises(ValueError, match="world_size"):
        pd.run_world(_rank_times_ten, 0)
    with pytest.raises(ValueError, match="start_method"):
        pd.run_world(_rank_times_ten, 1, start_method="teleport")
    with pytest.raises(ValueError, match="timeout"):
        pd.run_world(_rank_times_ten, 1, timeout=0)


def _world_dist_backend(rank: int) -> str:
    world = pd.get_world()
    assert world is not None
    return str(world.dist_backend)


def test_run_world_names_the_process_group_backend_as_world_does() -> None:
    """``dist_backend=`` (World's name) and ``backend=`` (its older name) reach every rank's World."""
    both = pd.run_world(_world_dist_backend, 2, init_rpc=False, dist_backend="gloo", timeout=60)
    assert both == ["gloo", "gloo"]
    assert pd.run_world(_world_dist_backend, 1, init_rpc=False, backend="gloo", timeout=60) == ["gloo"]
    assert pd.run_world(_world_dist_backend, 1, init_rpc=False, timeout=60) == ["gloo"]
    children = psutil.Process().children()
    with pytest.raises(TypeError, match="dist_backend or backend"):
        pd.run_world(_world_dist_backend, 1, backend="gloo", dist_backend="gloo")
    assert psutil.Process().children() == children
    with pytest.raises(ValueError, match="'teleport'"):
        pd.run_world(_world_dist_backend, 1, init_rpc=False, dist_backend="teleport", timeout=60)


def test_run_world_refuses_fork_with_rpc_where_cuda_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forked ranks cannot start TensorPipe where CUDA is present: a clear error, no rank started."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    children = psutil.Process().children()
    with pytest.raises(ValueError, match=r"fork.*CUDA.*spawn"):
        pd.run_world(_rank_times_ten, 2, start_method="fork", rpc_backend="tensorpipe")
    assert psutil.Process().children() == children
    # without RPC, or with the c10d backend (gloo needs no CUDA), a forked rank is fine
    assert pd.run_world(_rank_times_ten, 2, start_method="fork", init_rpc=False, timeout=60) == [0, 10]
    assert pd.run_world(_rank_times_ten, 2, start_method="fork", rpc_backend="c10d", timeout=60) == [0, 10]
