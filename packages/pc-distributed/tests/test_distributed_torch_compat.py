"""The store layer's torch-facing module: its capability checks, both branches on the torch running tests."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from pc_distributed._store import _torch_store


def _client_round_trip(store: Any) -> None:
    client = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", _torch_store.store_port(store), is_master=False, timeout=timedelta(seconds=30)
    )
    client.set("k", b"v")
    assert store.get("k") == b"v"


def test_master_store_serves_on_this_torch() -> None:
    # torch 2.4's default (libuv) server refused the listening descriptor: run_world could not start there.
    store = _torch_store.master_store("127.0.0.1", 0, 1, 30.0)
    _client_round_trip(store)
    assert _torch_store._listen_fd_needs_legacy is not None


class _LibuvRefusesFd:
    """A stand-in TCPStore whose default server refuses a listening fd, as torch 2.4's libuv server does."""

    calls: list[dict[str, Any]] = []

    def __init__(self, host: str, port: int, world_size: int, **options: Any) -> None:
        type(self).calls.append(options)
        if options.get("master_listen_fd") is not None and options.get("use_libuv", True):
            raise NotImplementedError(
                "The libuv TCPStore backend does not support initialization with an listen fd"
            )
        self.fd = options["master_listen_fd"]


def test_master_store_falls_back_to_the_legacy_server_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_torch_store, "_TCPStore", _LibuvRefusesFd)
    monkeypatch.setattr(_torch_store, "_listen_fd_needs_legacy", None)
    _LibuvRefusesFd.calls = []
    first = _torch_store.master_store("127.0.0.1", 0, 1, 5.0)
    assert [c.get("use_libuv", True) for c in _LibuvRefusesFd.calls] == [True, False]
    assert _torch_store._listen_fd_needs_legacy is True
    second = _torch_store.master_store("127.0.0.1", 0, 1, 5.0)
    assert [c.get("use_libuv", True) for c in _LibuvRefusesFd.calls] == [True, False, False]
    for store in (first, second):
        os.close(store.fd)  # the stand-in does not own its descriptor


def test_master_store_uses_the_default_server_where_it_takes_the_fd(monkeypatch: pytest.MonkeyPatch) -> None:
    class Accepts(_LibuvRefusesFd):
        calls: list[dict[str, Any]] = []

        def __init__(self, host: str, port: int, world_size: int, **options: Any) -> None:
            type(self).calls.append(options)
            self.fd = options["master_listen_fd"]

    monkeypatch.setattr(_torch_store, "_TCPStore", Accepts)
    monkeypatch.setattr(_torch_store, "_listen_fd_needs_legacy", None)
    store = _torch_store.master_store("127.0.0.1", 0, 1, 5.0)
    os.close(store.fd)
    assert ["use_libuv" in c for c in Accepts.calls] == [False]
    assert _torch_store._listen_fd_needs_legacy is False


def test_master_store_closes_the_socket_when_both_servers_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    class Refuses:
        fds: list[int] = []

        def __init__(self, host: str, port: int, world_size: int, **options: Any) -> None:
            type(self).fds.append(options["master_listen_fd"])
            raise NotImplementedError("no server")

    monkeypatch.setattr(_torch_store, "_TCPStore", Refuses)
    monkeypatch.setattr(_torch_store, "_listen_fd_needs_legacy", None)
    with pytest.raises(NotImplementedError):
        _torch_store.master_store("127.0.0.1", 0, 1, 5.0)
    with pytest.raises(OSError):
        os.fstat(Refuses.fds[0])


@pytest.mark.parametrize("agent_env", [{}, {"TORCHELASTIC_USE_AGENT_STORE": "True"}])
def test_open_store_gives_the_same_unprefixed_client_on_every_torch(
    monkeypatch: pytest.MonkeyPatch, agent_env: dict[str, str]
) -> None:
    # torch 2.4's tcp:// handler, when an agent serves the store, needed TORCHELASTIC_RESTART_COUNT (every
    # run_world rank failed with KeyError) and prefixed the keys; the World opens a plain client itself.
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    for key, value in agent_env.items():
        monkeypatch.setenv(key, value)
    server = _torch_store.master_store("127.0.0.1", 0, 2, 30.0)
    client = _torch_store.open_store(f"tcp://127.0.0.1:{_torch_store.store_port(server)}", 1, 2, 30.0)
    assert _torch_store.store_port(client) == _torch_store.store_port(server)
    client.set("plain", b"1")
    assert server.get("plain") == b"1"  # no prefix between the client and the server


def test_open_store_leaves_other_urls_to_torchs_handlers(tmp_path: Any) -> None:
    store = _torch_store.open_store(f"file://{tmp_path / 'store'}", 0, 1, 30.0)
    store.set("k", b"v")
    assert store.get("k") == b"v"
    assert _torch_store.store_port(store) is None
