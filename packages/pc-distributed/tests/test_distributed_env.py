"""Pure helpers: rank/size/address resolution and exception envelopes (no processes started)."""

from __future__ import annotations

import pickle
import sys
import threading

import pytest

from pc_distributed._checks import optional_timeout, resolve_timeout
from pc_distributed._errors import RankDiedError, RemoteTraceback, portable_exception, reraise_remote
from pc_distributed._torch_errors import is_timeout, peer_error
from pc_distributed.world._env import check_name, resolve_world_spec


def test_defaults_to_a_one_process_loopback_world_on_a_free_port() -> None:
    spec = resolve_world_spec(-1, -1, None, None, env={})
    assert (spec.rank, spec.world_size, spec.dist_url, spec.rpc_url) == (
        0,
        1,
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:0",
    )
    assert spec.serves_loopback()
    assert not spec.agent_store


def test_torchrun_environment_is_read() -> None:
    env = {
        "RANK": "2",
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    spec = resolve_world_spec(-1, -1, None, None, env=env)
    assert (spec.rank, spec.world_size, spec.dist_url) == (2, 4, "tcp://10.0.0.5:29500")
    assert spec.agent_store
    assert not spec.serves_loopback()


def test_arguments_win_over_the_environment_and_rpc_follows_dist() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "1234"}
    spec = resolve_world_spec(0, 3, "tcp://127.0.0.1:999", None, env=env)
    assert (spec.rank, spec.world_size, spec.rpc_url) == (0, 3, "tcp://127.0.0.1:999")
    spec = resolve_world_spec(0, 1, None, "tcp://127.0.0.1:77", env={})
    assert spec.rpc_url == "tcp://127.0.0.1:77"


def test_ipv6_loopback_is_bracketed() -> None:
    spec = resolve_world_spec(0, 1, None, None, env={"MASTER_ADDR": "::1", "MASTER_PORT": "5"})
    assert spec.dist_url == "tcp://[::1]:5"
    assert spec.serves_loopback()


@pytest.mark.parametrize(
    ("rank", "size", "env", "error", "match"),
    [
        (-1, 2, {}, ValueError, "rendezvous address"),
        (3, 2, {"MASTER_PORT": "1"}, ValueError, r"rank must be in \[0, 2\)"),
        (0, 0, {}, ValueError, "world_size must be >= 1"),
        ("0", 1, {}, TypeError, "rank must be an int"),
        (-1, -1, {"RANK": "x"}, ValueError, "RANK must be an integer"),
        (0, 1, {"MASTER_PORT": "70000"}, ValueError, "MASTER_PORT"),
    ],
)
def test_bad_world_specs(rank: object, size: object, env: dict[str, str], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        resolve_world_spec(rank, size, None, None, env=env)  # type: ignore[arg-type]


def test_names() -> None:
    assert check_name("worker:0-a_b") == "worker:0-a_b"
    with pytest.raises(ValueError, match="has space"):
        check_name("has space")
    with pytest.raises(TypeError, match="int"):
        check_name(3)


class _LockedError(Exception):
    def __init__(self) -> None:
        super().__init__("with a lock")
        self.lock = threading.Lock()


def test_portable_exception_keeps_picklable_ones_and_replaces_the_rest() -> None:
    err = KeyError("k")
    assert portable_exception(err) is err
    replaced = portable_exception(_LockedError())
    assert type(replaced) is RuntimeError
    assert "_LockedError" in str(replaced)
    assert "not picklable" in str(replaced)


def test_reraise_remote_sets_cause_and_note() -> None:
    exc = reraise_remote(ValueError("v"), "Traceback: remote", "rank 3")
    assert isinstance(exc.__cause__, RemoteTraceback)
    assert "Traceback: remote" in str(exc.__cause__)
    if sys.version_info >= (3, 11):  # exception notes exist from Python 3.11 on
        assert any("rank 3" in n for n in getattr(exc, "__notes__", []))


def test_rank_died_error_pickles() -> None:
    err = pickle.loads(pickle.dumps(RankDiedError(1, -9, "rank 1 was killed by SIGKILL")))
    assert (err.rank, err.exitcode, str(err)) == (1, -9, "rank 1 was killed by SIGKILL")
    assert isinstance(err, RuntimeError)


def test_addr_argument_wins_over_master_addr() -> None:
    env = {"MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "2"}
    spec = resolve_world_spec(-1, -1, None, None, env=env, addr="127.0.0.1")
    assert spec.dist_url == "tcp://127.0.0.1:29500"
    assert spec.serves_store()
    assert spec.serves_loopback()
    assert spec.on_loopback()
    outside = resolve_world_spec(-1, -1, None, None, env=env)
    assert outside.serves_store()
    assert not outside.serves_loopback()
    assert not outside.on_loopback()
    assert not resolve_world_spec(1, 2, None, None, env=env).serves_store()  # only rank 0 serves
    with pytest.raises(ValueError, match="not both"):
        resolve_world_spec(0, 1, "tcp://127.0.0.1:1", None, env={}, addr="127.0.0.1")
    with pytest.raises(TypeError, match="addr must be a non-empty str"):
        resolve_world_spec(0, 1, None, None, env={}, addr="")


def test_one_timeout_convention() -> None:
    assert optional_timeout("timeout", None) is None
    assert optional_timeout("timeout", -1) is None  # another spelling of "the default"
    assert optional_timeout("timeout", 2) == 2.0
    assert resolve_timeout(None, 60.0) == 60.0
    assert resolve_timeout(-1, 60.0) == 60.0
    assert resolve_timeout(0.5, 60.0) == 0.5
    for bad in (0, -2, float("nan")):
        with pytest.raises(ValueError, match=r"timeout must be None \(the default\) or a positive"):
            optional_timeout("timeout", bad)
    for bad in ("1", True):
        with pytest.raises(TypeError, match="timeout must be None"):
            optional_timeout("timeout", bad)


def test_peer_errors_are_classified_by_type_first() -> None:
    import torch.distributed as dist

    # By type: the message would say otherwise.
    network = dist.DistNetworkError("timed out? no: the peer closed the connection")
    assert isinstance(peer_error(network, "peer", "rpc"), ConnectionError)
    assert not is_timeout(network)
    assert isinstance(peer_error(ConnectionResetError("timeout"), "peer", "rpc"), ConnectionError)
    timeout = peer_error(TimeoutError("anything"), "peer", "rpc_sync")
    assert isinstance(timeout, TimeoutError)
    assert "rpc_sync to 'peer' timed out" in str(timeout)
    # The documented fallback for torch's RPC agent, which raises a plain RuntimeError for both.
    assert isinstance(peer_error(RuntimeError("RPC ran for more than set timeout"), "p", "rpc"), TimeoutError)
    assert isinstance(peer_error(RuntimeError("Connection reset by peer"), "p", "rpc"), ConnectionError)
    other = peer_error(RuntimeError("something else"), "p", "rpc")
    assert type(other) is RuntimeError
    assert "rpc to 'p' failed" in str(other)


def test_tensorpipes_refusal_of_a_cuda_tensor_is_a_value_error_naming_the_backend_that_carries_one() -> None:
    # torch's text (it says "Pipe", which the connection fallback would take for a lost peer)
    refused = RuntimeError(
        "TensorPipe RPC backend only supports CPU tensors by default, please move your tensors to CPU before "
        "sending them over RPC, or call `set_device_map` on `TensorPipeRpcBackendOptions` to explicitly "
        "configure device mapping. Request device mapping is not available for destination worker1"
    )
    error = peer_error(refused, "1", "rpc_sync")
    assert type(error) is ValueError
    assert "rpc_sync to '1'" in str(error)
    assert "rpc_backend='c10d'" in str(error)
    assert "only supports CPU tensors" in str(error)


def test_an_explicit_tcp_url_is_served_by_rank_zero_unless_an_agent_serves_it() -> None:
    spec = resolve_world_spec(0, 2, "tcp://127.0.0.1:2950", None, env={})
    assert (spec.dist_url, spec.rpc_url, spec.host, spec.port) == (
        "tcp://127.0.0.1:2950",
        "tcp://127.0.0.1:2950",
        "127.0.0.1",
        2950,
    )
    assert spec.serves_store()
    assert spec.on_loopback()
    assert not resolve_world_spec(1, 2, "tcp://127.0.0.1:2950", None, env={}).serves_store()
    agent = resolve_world_spec(
        0, 2, "tcp://127.0.0.1:2950", None, env={"TORCHELASTIC_USE_AGENT_STORE": "True"}
    )
    assert agent.agent_store
    assert not agent.serves_store()
    # a one-process world on an explicit address (port 0: a free one)
    assert resolve_world_spec(-1, -1, "tcp://127.0.0.1:0", None, env={}).serves_store()


def test_tcp_urls_with_ipv6_brackets_and_host_names() -> None:
    spec = resolve_world_spec(0, 2, "tcp://[::1]:2950", None, env={})
    assert (spec.dist_url, spec.host, spec.port) == ("tcp://[::1]:2950", "::1", 2950)
    assert spec.serves_loopback()
    named = resolve_world_spec(0, 2, "tcp://node-a.example:2950/", None, env={})
    assert (named.dist_url, named.host, named.on_loopback()) == (
        "tcp://node-a.example:2950",
        "node-a.example",
        False,
    )


def test_a_url_query_gives_rank_and_world_size_as_torch_reads_it() -> None:
    spec = resolve_world_spec(-1, -1, "tcp://127.0.0.1:2950?rank=1&world_size=3&use_libuv=0", None, env={})
    assert (spec.rank, spec.world_size, spec.dist_url) == (1, 3, "tcp://127.0.0.1:2950")
    assert resolve_world_spec(1, 3, "tcp://127.0.0.1:2950?rank=1&world_size=3", None, env={}).rank == 1
    # the query wins over the environment, as in torch's env:// handler
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "2950"}
    assert resolve_world_spec(-1, -1, "env://?rank=1", None, env=env).rank == 1
    file_spec = resolve_world_spec(-1, -1, "file:///tmp/rdzv?rank=0&world_size=2", None, env={})
    assert (file_spec.rank, file_spec.world_size, file_spec.dist_url) == (0, 2, "file:///tmp/rdzv")
    with pytest.raises(ValueError, match=r"rank is 0, but dist_init_method .* says rank=1"):
        resolve_world_spec(0, 2, "tcp://127.0.0.1:2950?rank=1", None, env={})
    with pytest.raises(ValueError, match="the init methods disagree on world_size"):
        resolve_world_spec(
            -1, -1, "tcp://127.0.0.1:1?world_size=2", "tcp://127.0.0.1:2?world_size=3&rank=0", env={}
        )
    with pytest.raises(ValueError, match=r"unknown query key\(s\) \['ranks'\]"):
        resolve_world_spec(-1, -1, "tcp://127.0.0.1:2950?ranks=1", None, env={})
    with pytest.raises(ValueError, match="world_size must be an integer, got 'two'"):
        resolve_world_spec(-1, -1, "tcp://127.0.0.1:2950?world_size=two", None, env={})


def test_env_url_reads_master_addr_and_port_and_is_served_like_them() -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "2950", "RANK": "0", "WORLD_SIZE": "2"}
    spec = resolve_world_spec(-1, -1, "env://", None, env=env)
    assert spec == resolve_world_spec(-1, -1, None, None, env=env)
    assert (spec.dist_url, spec.serves_store()) == ("tcp://127.0.0.1:2950", True)
    with pytest.raises(ValueError, match=r"reads MASTER_ADDR and MASTER_PORT, but \['MASTER_PORT'\] not set"):
        resolve_world_spec(0, 1, "env://", None, env={"MASTER_ADDR": "127.0.0.1"})
    with pytest.raises(ValueError, match="MASTER_PORT must be in"):
        resolve_world_spec(0, 1, "env://", None, env={"MASTER_ADDR": "h", "MASTER_PORT": "65536"})


def test_file_url_has_no_server() -> None:
    spec = resolve_world_spec(1, 2, "file:///tmp/rdzv", None, env={})
    assert (spec.dist_url, spec.rpc_url, spec.host, spec.port) == (
        "file:///tmp/rdzv",
        "file:///tmp/rdzv",
        None,
        None,
    )
    assert not resolve_world_spec(0, 2, "file:///tmp/rdzv", None, env={}).serves_store()
    other = resolve_world_spec(0, 2, "file:///tmp/rdzv", "file:///tmp/rpc", env={})
    assert (other.rpc_url, other.rpc_host) == ("file:///tmp/rpc", None)


def test_rpc_init_method_is_the_worlds_store_or_one_of_its_own() -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "2950"}
    for same in ("tcp://127.0.0.1:2950", "env://", "tcp://127.0.0.1:2950?use_libuv=1"):
        shared = resolve_world_spec(0, 2, "tcp://127.0.0.1:2950", same, env=env)
        assert (shared.rpc_url, shared.rpc_host, shared.rpc_port) == ("tcp://127.0.0.1:2950", None, None)
    own = resolve_world_spec(1, 2, "tcp://127.0.0.1:2950", "tcp://127.0.0.1:2951", env=env)
    assert (own.rpc_url, own.rpc_host, own.rpc_port) == ("tcp://127.0.0.1:2951", "127.0.0.1", 2951)
    # rank 0 serves RPC's own store even where an agent serves the World's (no agent serves that one)
    agent = resolve_world_spec(
        0, 2, None, "tcp://127.0.0.1:2951", env={**env, "TORCHELASTIC_USE_AGENT_STORE": "True"}
    )
    assert (agent.agent_store, agent.rpc_host) == (True, "127.0.0.1")


@pytest.mark.parametrize(
    ("dist", "rpc", "size", "error", "match"),
    [
        ("127.0.0.1:2950", None, 1, ValueError, "must be 'tcp://host:port', 'env://'"),
        ("http://127.0.0.1:2950", None, 1, ValueError, "must be 'tcp://host:port'"),
        ("tcp://127.0.0.1", None, 1, ValueError, "names a host and a port"),
        ("tcp://:2950", None, 1, ValueError, "names a host and a port"),
        ("tcp://127.0.0.1:70000", None, 1, ValueError, r"port must be an integer in \[0, 65535\]"),
        ("tcp://127.0.0.1:http", None, 1, ValueError, r"port must be an integer in \[0, 65535\]"),
        ("tcp://127.0.0.1:2950/x", None, 1, ValueError, "has no path"),
        ("env://127.0.0.1:2950", None, 1, ValueError, "names no address"),
        ("file://tmp/rdzv", None, 1, ValueError, "names an absolute path"),
        ("file://", None, 1, ValueError, "names an absolute path"),
        ("tcp://127.0.0.1:0", None, 2, ValueError, "2 processes cannot meet at port 0"),
        ("tcp://127.0.0.1:2950", "tcp://127.0.0.1:0", 2, ValueError, "rpc_init_method .* port 0"),
        ("tcp://127.0.0.1:2950", "udp://x:1", 1, ValueError, "rpc_init_method must be 'tcp://host:port'"),
        (b"tcp://127.0.0.1:2950", None, 1, TypeError, "dist_init_method must be a str or None, got bytes"),
        ("tcp://127.0.0.1:2950", 2951, 1, TypeError, "rpc_init_method must be a str or None, got int"),
    ],
)
def test_bad_init_methods(dist: object, rpc: object, size: int, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        resolve_world_spec(0, size, dist, rpc, env={})  # type: ignore[arg-type]


def test_members_settings_are_compared_by_name() -> None:
    from pc_distributed.world._rendezvous import _disagreements

    same = {"RPC backends": "c10d", "process-group backends": "gloo"}
    assert _disagreements(["a", "b"], [same, dict(same)]) == []
    other = {**same, "RPC backends": "tensorpipe"}
    assert _disagreements(["a", "b"], [same, other]) == [
        "members use different RPC backends: {'a': 'c10d', 'b': 'tensorpipe'}"
    ]
    assert _disagreements(["a", "a"], [same, other]) == [
        "member names must be unique, got ['a', 'a'] (by rank)",
        "members use different RPC backends: {'rank 0': 'c10d', 'rank 1': 'tensorpipe'}",
    ]
