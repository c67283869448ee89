"""The RPC backends are chosen and started in one place (``rpc._backends``), for World and run_world alike.

A fake third backend registered in the table (one entry, as a real one is added) must be accepted by name, and
``run_world`` must check its ``rpc_backend`` against the same table. Nothing here spawns a process.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import pytest

import pc_distributed as pd
from pc_distributed.rpc import _backends
from pc_distributed.rpc._backends import BACKENDS, BackendSetup, choose_backend, start_backend
from pc_distributed.rpc._c10d import C10dBackend
from pc_distributed.rpc._tensorpipe import TensorPipeBackend

pytestmark = pytest.mark.backends_inside


class _FakeBackend:
    """A backend that records its start and its shutdown and carries no calls."""

    name = "fake"
    why_missing: str | None = None
    started: list[BackendSetup] = []

    def __init__(self, setup: BackendSetup) -> None:
        self.setup = setup
        self.shutdowns: list[tuple[bool, float]] = []

    @classmethod
    def missing(cls) -> str | None:
        return cls.why_missing

    @classmethod
    def start(cls, setup: BackendSetup) -> _FakeBackend:
        cls.started.append(setup)
        return cls(setup)

    def shutdown(self, graceful: bool, timeout: float) -> None:
        self.shutdowns.append((graceful, timeout))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> type[_FakeBackend]:
    """The registry with ``fake`` added (and no PC_RPC_BACKEND), the fake's records cleared."""
    monkeypatch.setattr(_FakeBackend, "started", [])
    monkeypatch.setattr(_FakeBackend, "why_missing", None)
    monkeypatch.setattr(_backends, "BACKENDS", MappingProxyType({**BACKENDS, "fake": _FakeBackend}))
    monkeypatch.delenv(_backends.ENV_VAR, raising=False)
    return _FakeBackend


def _unused(rank: int) -> None:  # pragma: no cover - run_world refuses before any rank runs
    raise AssertionError("no rank should have started")


def test_each_name_resolves_to_its_backend_class() -> None:
    assert BACKENDS["tensorpipe"] is TensorPipeBackend
    assert BACKENDS["c10d"] is C10dBackend
    assert all(cls.name == name for name, cls in BACKENDS.items())
    assert choose_backend("C10D") == "c10d"
    if TensorPipeBackend.missing() is None:
        assert choose_backend("TensorPipe") == "tensorpipe"


def test_an_unknown_name_is_a_value_error_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="'grpc'") as info:
        choose_backend("grpc")
    for name in [*BACKENDS, "auto"]:
        assert repr(name) in str(info.value)
    with pytest.raises(ValueError, match="'grpc'") as info:
        start_backend("grpc", _setup())
    for name in BACKENDS:
        assert repr(name) in str(info.value)


def test_a_backend_this_torch_lacks_is_refused_naming_the_usable_ones(fake: type[_FakeBackend]) -> None:
    fake.why_missing = "this torch build has no fake transport"
    with pytest.raises(ValueError, match=r"no fake transport; use .*'auto'") as info:
        choose_backend("fake")
    assert "'fake' or" not in str(info.value)  # the missing one is not offered
    assert "'c10d'" in str(info.value)


def test_run_world_checks_the_name_against_the_same_registry(fake: type[_FakeBackend]) -> None:
    with pytest.raises(ValueError, match="'grpc'") as info:
        pd.run_world(_unused, 1, rpc_backend="grpc")
    assert "'fake'" in str(info.value)  # the table the World starts from
    fake.why_missing = "this torch build has no fake transport"
    with pytest.raises(ValueError, match="no fake transport"):
        pd.run_world(_unused, 1, rpc_backend="fake")
    assert fake.started == []


def _setup() -> BackendSetup:
    def never() -> Any:
        raise AssertionError("an unknown backend must not reach the store")

    return BackendSetup(
        member="0",
        rank=0,
        world_size=1,
        names=("0",),
        timeout=1.0,
        start_timeout=1.0,
        busy_poll=False,
        link_store=never,
        rpc_init_method=never,
    )
