"""EtcdStore against a real one-member etcd on loopback: torch's Store semantics, threads, failures, and the
elastic trainer and a gloo group on it.

The semantics are checked against torch's own ``HashStore`` as the oracle (the same requests must give the
same answers), so a difference from what torch's stores do shows up here. A cluster losing its majority is in
``tests-integration/test_integration_elastic_multihost.py`` (simulated hosts).
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed_elastic_testutils import make_model, make_optimizer, params, replay, run_threads, shard_loss
from etcd_testutils import etcd_server

import pc_distributed as pd
from pc_distributed._store import BoundedStore

pytestmark = pytest.mark.backends_inside


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with etcd_server(tmp_path_factory.mktemp("etcd")) as url:
        yield url


def _store(url: str, timeout: float = 10.0) -> pd.EtcdStore:
    return pd.EtcdStore(url, prefix=f"{uuid.uuid4().hex}/", timeout=timeout)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens there once closed


def _requests(store: Any) -> list[Any]:
    """A sequence of requests whose answers the oracle comparison checks, in order."""
    out: list[Any] = []
    store.set("a", "1")
    out.append(store.get("a"))
    out.append(store.compare_set("a", "1", "2"))  # holds expected: set
    out.append(store.compare_set("a", "1", "3"))  # does not: the current value
    out.append(store.compare_set("new", "", "n"))  # missing, expected empty: set
    out.append(store.compare_set("none", "x", "y"))  # missing, expected not empty: expected, nothing set
    out.append(store.check(["none"]))
    out.append(store.add("c", 5))
    out.append(store.add("c", -2))
    out.append(store.check(["a", "c", "new"]))
    out.append(store.delete_key("a"))
    out.append(store.delete_key("a"))
    out.append(store.check(["a"]))
    store.set("bytes", b"\x00\xff\x80")
    out.append(store.get("bytes"))
    out.append(store.num_keys())
    return out


def test_requests_answer_as_torchs_hash_store_does(etcd: str) -> None:
    assert _requests(_store(etcd)) == _requests(dist.HashStore())


def test_prefixes_keep_stores_apart_in_one_cluster(etcd: str) -> None:
    one, two = _store(etcd), _store(etcd)
    one.set("k", "1")
    two.set("k", "2")
    two.set("other", "x")
    assert (one.get("k"), two.get("k")) == (b"1", b"2")
    assert (one.num_keys(), two.num_keys()) == (1, 2)
    view = dist.PrefixStore("p", one)  # torch's views work over it
    view.set("x", "y")
    assert one.get("p/x") == b"y"
    assert view.multi_get(["x"]) == [b"y"]


def test_get_and_wait_see_a_key_set_between_the_read_and_the_watch(
    etcd: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watch starts at the revision after the read, so a set in between is not missed (a watch from
    "now" would wait for the timeout)."""
    prefix = f"{uuid.uuid4().hex}/"
    store, other = pd.EtcdStore(etcd, prefix=prefix, timeout=5.0), pd.EtcdStore(etcd, prefix=prefix)
    original = pd.EtcdStore._watch_for
    seen = []

    def set_first(self: pd.EtcdStore, key: str, start: int, deadline: float) -> dict[str, Any]:
        seen.append(key)
        other.set(key, f"v-{key}")  # after the read found it missing, before the watch is made
        return original(self, key, start, deadline)

    monkeypatch.setattr(pd.EtcdStore, "_watch_for", set_first)
    # A watch that missed the sets would end in DistStoreError at the 5 s timeout, not return the values.
    assert store.get("late") == b"v-late"
    store.wait(["w1", "w2"], timedelta(seconds=5))
    assert seen == ["late", "w1", "w2"]


def test_a_watch_cancelled_by_a_compaction_reads_the_key_again(
    etcd: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd cancels a watch whose start revision was compacted away; ``get`` then reads the key again."""
    store = _store(etcd, timeout=5.0)
    for i in range(3):
        store.set("churn", str(i))
    _, now = store._range("churn")
    store._post("/v3/kv/compaction", {"revision": str(now)})
    assert store._watch_for("missing", 1, time.monotonic() + 5.0) is None  # cancelled, not a timeout
    reads = []
    original = pd.EtcdStore._range

    def stale_then_set(self: pd.EtcdStore, key: str) -> tuple[Any, int]:
        kv, revision = original(self, key)
        reads.append(kv)
        if len(reads) == 1:  # the first read: missing, at a revision since compacted away
            self.set(key, "there")
            return None, 1
        return kv, revision

    monkeypatch.setattr(pd.EtcdStore, "_range", stale_then_set)
    assert store.get("k") == b"there"
    assert len(reads) == 2


def test_get_waits_for_a_key_another_thread_sets(etcd: str) -> None:
    store = _store(etcd)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        getter = pool.submit(store.get, "later")
        threading.Timer(0.2, store.set, ("later", "here")).start()
        assert getter.result(30) == b"here"


def test_a_key_that_stays_missing_is_torchs_store_error(etcd: str) -> None:
    store = _store(etcd, timeout=0.5)
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="'never' was not set in time"):
        store.get("never")
    with pytest.raises(dist.DistStoreError, match="'never2' was not set in time"):
        store.wait(["never2"], timedelta(seconds=0.3))
    assert time.monotonic() - start < 10.0


def test_add_is_atomic_under_threads(etcd: str) -> None:
    """Four threads, 40 increments each: every returned value is distinct and the total is exact."""
    store = _store(etcd)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(lambda: [store.add("n", 1) for _ in range(40)]) for _ in range(4)]
        seen = [v for f in futures for v in f.result(120)]
    assert sorted(seen) == list(range(1, 161))
    assert store.get("n") == b"160"


def test_compare_set_has_one_winner_under_threads(etcd: str) -> None:
    store = _store(etcd)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: store.compare_set("owner", "", f"t{i}"), range(8)))
    winner = store.get("owner")
    assert answers == [winner] * 8  # everyone reads the first writer's value


def test_a_dead_endpoint_is_skipped(etcd: str) -> None:
    store = pd.EtcdStore([f"http://127.0.0.1:{_closed_port()}", etcd], prefix=f"{uuid.uuid4().hex}/")
    store.set("k", "v")
    assert store.get("k") == b"v"


def test_no_endpoint_answering_is_a_timeout_naming_them() -> None:
    port = _closed_port()
    store = pd.EtcdStore(f"http://127.0.0.1:{port}", timeout=0.5)
    with pytest.raises(TimeoutError, match=f"127.0.0.1:{port}"):
        store.set("k", "v")


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((), {"endpoints": 5}, TypeError, "endpoints must be"),
        ((), {"endpoints": []}, TypeError, "endpoints must be"),
        ((), {"endpoints": "https://h:1"}, ValueError, "http://host:port"),
        ((), {"endpoints": "http://h"}, ValueError, "http://host:port"),
        (("http://h:1",), {"timeout": 0}, ValueError, "timeout"),
        (("http://h:1",), {"prefix": 3}, TypeError, "prefix"),
    ],
)
def test_bad_arguments_are_named(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        pd.EtcdStore(*args, **kwargs)


def test_a_gloo_group_forms_on_it(etcd: str) -> None:
    store = _store(etcd)

    def member(rank: int) -> torch.Tensor:
        group = dist.ProcessGroupGloo(dist.PrefixStore("g", store), rank, 2, timedelta(seconds=30))
        t = torch.full((3,), float(rank + 1))
        group.allreduce([t]).wait()
        return t

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(member, range(2)))
    for t in results:
        assert torch.equal(t, torch.full((3,), 3.0))


def test_elastic_members_train_on_it_and_equal_a_replay(etcd: str) -> None:
    store = _store(etcd)
    fast: dict[str, Any] = {"heartbeat_period": 0.1, "member_timeout": 10.0, "collective_timeout": 10.0}

    def member(name: str) -> dict[str, Any]:
        model = make_model(name)
        with pd.ElasticDataParallel(
            model, make_optimizer(model), name=name, store=store, initial_members=3, **fast
        ) as edp:
            while edp.step < 5:
                edp.train_step(lambda ctx: shard_loss(model, ctx))
            return {"params": params(model), "log": list(edp.quorum_log)}

    out = run_threads(member, ["0", "1", "2"])
    for r in out.values():
        assert not isinstance(r, BaseException), r
    log = out["0"]["log"]
    assert log == [(s, ("0", "1", "2")) for s in range(5)]
    for name, r in out.items():
        assert r["log"] == log
        for got, want in zip(r["params"], replay(log), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=f"member {name}")


class _GivesUp:
    """A store that gives up on its own (as an EtcdStore cut off from its cluster's majority does)."""

    def set(self, key: str, value: str) -> None:
        raise TimeoutError("no etcd endpoint answered /v3/kv/put")


def test_a_store_giving_up_itself_is_a_timeout_naming_the_bounded_store_and_the_reason() -> None:
    bounded = BoundedStore(_GivesUp(), 5.0, "the elastic store of job 'j'")
    try:
        with pytest.raises(TimeoutError, match=r"the elastic store of job 'j'.*no etcd endpoint answered"):
            bounded.set("k", "v")
    finally:
        bounded.close()
