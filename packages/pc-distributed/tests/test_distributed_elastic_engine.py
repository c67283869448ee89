"""The elastic trainer's engines: choosing one, NCCL's capability checks (both branches), bounded collectives.

NCCL needs CUDA and one GPU per member, so its torch calls are replaced here by stand-ins with the same
methods; the real groups are checked by ``test_distributed_elastic_gpu.py`` on a machine with two GPUs.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pc_distributed import _torch_dist
from pc_distributed.parallel.elastic import _engine
from pc_distributed.parallel.elastic._engine import GlooEngine, NcclEngine, engine_for

CPU = torch.device("cpu")


# -- choosing an engine ---


def test_the_default_engine_is_gloo_and_names_are_checked() -> None:
    assert isinstance(engine_for(None, CPU, 5.0), GlooEngine)
    assert isinstance(engine_for("GLOO", CPU, 5.0), GlooEngine)
    with pytest.raises(TypeError, match="dist_backend must be a string"):
        engine_for(1, CPU, 5.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dist_backend must be one of"):
        engine_for("mpi", CPU, 5.0)
    with pytest.raises(ValueError, match="needs a module on a CUDA device"):
        engine_for("nccl", CPU, 5.0)


def test_nccl_on_a_build_without_it_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_torch_dist, "nccl_quorum_groups_available", lambda: False)
    with pytest.raises(RuntimeError, match="no abortable NCCL groups"):
        engine_for("nccl", torch.device("cuda", 0), 5.0)
    monkeypatch.setattr(_torch_dist, "nccl_quorum_groups_available", lambda: True)
    engine = engine_for("nccl", torch.device("cuda", 0), 5.0)
    assert isinstance(engine, NcclEngine)
    assert engine.device == torch.device("cuda", 0)


# -- NCCL's capability checks, both branches ---


class _Config:
    blocking = 1


class _Options:
    def __init__(self) -> None:
        self.config = _Config()
        self._timeout = timedelta(0)


class _FakeNccl:
    """Stands for ``ProcessGroupNCCL`` on torch 2.5 and later (``abort``)."""

    NCCLConfig = _Config
    Options = _Options
    made: list[_FakeNccl] = []

    def __init__(self, store: Any, rank: int, size: int, options: _Options) -> None:
        self.store, self.rank, self.size, self.options = store, rank, size, options
        self.calls: list[str] = []
        _FakeNccl.made.append(self)

    def abort(self) -> None:
        self.calls.append("abort")


class _FakeNcclShutdownOnly:
    """Stands for ``ProcessGroupNCCL`` on torch 2.4 (``_shutdown`` aborts; there is no ``abort``)."""

    NCCLConfig = _Config
    Options = _Options

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _shutdown(self) -> None:
        self.calls.append("_shutdown")


def test_this_cpu_build_has_no_nccl_groups() -> None:
    if _torch_dist._ProcessGroupNCCL is not None and dist.is_nccl_available():
        pytest.skip("this build has NCCL")
    assert not _torch_dist.nccl_quorum_groups_available()
    with pytest.raises(RuntimeError, match="no abortable NCCL groups"):
        _torch_dist.nccl_quorum_group(dist.HashStore(), "q", 0, 1, 5.0)


def test_nccl_groups_are_non_blocking_with_a_watchdog_beyond_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_torch_dist, "_ProcessGroupNCCL", _FakeNccl)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert _torch_dist.nccl_quorum_groups_available()
    group = _torch_dist.nccl_quorum_group(dist.HashStore(), "q", 1, 3, 5.0)
    assert isinstance(group, _FakeNccl)
    assert (group.rank, group.size) == (1, 3)
    assert group.options.config.blocking == 0
    assert group.options._timeout == timedelta(seconds=70)  # twice the bound plus a minute
    _torch_dist.abort_group(group)
    assert group.calls == ["abort"]
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert not _torch_dist.nccl_quorum_groups_available()


@pytest.mark.parametrize(("release", "usable"), [((2, 4), True), ((2, 5), False), ((2, 15), False)])
def test_shutdown_aborts_only_before_torch_2_5(
    monkeypatch: pytest.MonkeyPatch, release: tuple[int, int], usable: bool
) -> None:
    monkeypatch.setattr(_torch_dist, "_ProcessGroupNCCL", _FakeNcclShutdownOnly)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(_torch_dist, "_torch_release", lambda: release)
    assert _torch_dist.nccl_quorum_groups_available() is usable
    group = _FakeNcclShutdownOnly()
    if usable:
        _torch_dist.abort_group(group)
        assert group.calls == ["_shutdown"]
    else:  # from 2.5, _shutdown is the graceful destroy, which waits for the peers
        with pytest.raises(RuntimeError, match="has no abort"):
            _torch_dist.abort_group(group)
        assert group.calls == []


def test_torch_release_reads_this_torch() -> None:
    major, minor = _torch_dist._torch_release()
    assert torch.__version__.startswith(f"{major}.{minor}.")


# -- the bounded collective, on stand-in groups (CPU tensors) ---


class _Work:
    def __init__(self, action: Any) -> None:
        self.action = action

    def wait(self, *args: Any) -> None:
        self.action()


class _StandInGroup:
    """A group of one member and a peer whose contribution is ``peer``; ``mode`` makes it hang or fail."""

    def __init__(self, mode: str = "ok", peer: float = 10.0) -> None:
        self.mode = mode
        self.peer = peer
        self.aborted = threading.Event()
        self.aborts = 0
        self.waited_out = threading.Event()  # set when a hung wait ended (by the abort)

    def _finish(self, fn: Any) -> _Work:
        def action() -> None:
            if self.mode == "hang":
                self.aborted.wait(60)
                self.waited_out.set()
                raise RuntimeError("stand-in: aborted")
            if self.mode == "fail":
                raise RuntimeError("stand-in: peer lost")
            fn()

        return _Work(action)

    def allreduce(self, tensors: list[torch.Tensor]) -> _Work:
        return self._finish(lambda: tensors[0].add_(self.peer))

    def broadcast(self, tensors: list[torch.Tensor], options: Any) -> _Work:
        return self._finish(lambda: tensors[0].fill_(int(self.peer)) if options.rootRank != 0 else None)

    def abort(self) -> None:
        self.aborts += 1
        self.aborted.set()


def test_the_nccl_engine_sums_and_broadcasts_in_place() -> None:
    engine = NcclEngine(5.0, CPU)
    group = _StandInGroup(peer=2.0)
    t = torch.ones(3)
    engine.all_reduce_sum(group, t)
    assert t.tolist() == [3.0, 3.0, 3.0]
    payload = torch.zeros(4, dtype=torch.uint8)
    engine.broadcast(group, payload, 1)
    assert payload.tolist() == [2, 2, 2, 2]
    assert group.aborts == 0
    engine.drop(group)
    assert group.aborts == 1


def test_a_hung_collective_raises_at_the_bound_and_the_drop_ends_it() -> None:
    engine = NcclEngine(0.5, CPU)
    group = _StandInGroup("hang")
    with pytest.raises(RuntimeError, match=r"no answer within 0\.5 s"):
        engine.all_reduce_sum(group, torch.ones(2))
    assert not group.waited_out.is_set()  # the helper thread is still blocked in the collective
    engine.drop(group)
    assert group.waited_out.wait(30)  # the abort ended it


def test_a_failed_collective_is_a_runtime_error_and_the_drop_aborts() -> None:
    engine = NcclEngine(5.0, CPU)
    group = _StandInGroup("fail")
    with pytest.raises(RuntimeError, match="peer lost"):
        engine.broadcast(group, torch.zeros(2, dtype=torch.uint8), 1)
    engine.drop(group)
    assert group.aborts == 1


def test_the_gloo_engine_stages_through_the_host_and_drops_without_a_call() -> None:
    calls: list[str] = []

    class Group:
        def allreduce(self, tensors: list[torch.Tensor]) -> _Work:
            calls.append(tensors[0].device.type)
            return _Work(lambda: tensors[0].mul_(2))

        def abort(self) -> None:  # never called: a gloo group is let go
            calls.append("abort")

    engine = GlooEngine(5.0)
    t = torch.ones(2)
    engine.all_reduce_sum(Group(), t)
    engine.drop(Group())
    assert t.tolist() == [2.0, 2.0]
    assert calls == ["cpu"]


def test_the_nccl_device_types_are_cuda_only() -> None:
    assert _engine.NCCL_DEVICE_TYPES == ("cuda",)
