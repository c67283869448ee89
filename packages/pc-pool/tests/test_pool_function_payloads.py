"""A task function pickled by value (a script's ``__main__`` function, a lambda, a closure) is pickled once
and its payload reused until something that travels with it changes; the next call then carries the change."""

from __future__ import annotations

import contextlib
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pool_testutils as tu
import pytest
import torch

import pc_pickle
import pc_pickle._pickler
from pc_pool import Pool, WorkerDiedError
from pc_pool._func_payloads import FunctionPayloads, same, snapshot

# Run as a script's __main__ (see _script): its functions travel by value, with the globals they use.
_SCRIPT = """
import os
from typing import Optional

SCALE = 2
CONFIG = [1, 2]


def helper(x):
    return x * SCALE


def scaled(x):
    return x * SCALE


def with_helper(x):
    return helper(x) + 1


def with_defaults(x, k=3, *, m=4):
    return x * k * m


def absolute(x):
    return abs(x)


def summed(x):
    return x + sum(CONFIG)


def add_one(t):
    t.add_(1)


def whoami(x):
    return os.getpid(), x * SCALE


def make_whoami(k):
    def whoami(x):
        return os.getpid(), x * k

    return whoami


def fact(n):
    return 1 if n <= 1 else n * fact(n - 1)


def annotated(x: Optional[int] = None, *, y: "list[int]" = None) -> dict[str, int | None]:
    return {"x": x}


def make_scaler(k):
    def scale(x):
        return x * k

    return scale


def make_writer(buf):
    def write(v):
        buf.add_(v)

    return write


class Box:
    pass


def boxed(x):
    return Box, x
"""


def _script() -> dict[str, Any]:
    """A fresh namespace that ran ``_SCRIPT`` as ``__main__`` (its functions are pickled by value)."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(_SCRIPT, "<script>", "exec"), namespace)
    return namespace


def _code(source: str) -> types.CodeType:
    """The code of the one function ``source`` defines (to swap into a function's ``__code__``)."""
    namespace: dict[str, Any] = {}
    exec(source, namespace)
    (func,) = (v for v in namespace.values() if isinstance(v, types.FunctionType))
    return func.__code__


class _ByValueDumps:
    """Counts pc_pickle's by-value (dill) pickles, per object, made in this process.

    Objects are counted by id (holding them would keep shared tensors of closures alive past the test): a
    test asks only about objects it keeps alive, whose ids are not reused meanwhile.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: list[int] = []

    def record(self, obj: Any) -> None:
        with self._lock:
            self._seen.append(id(obj))

    def of(self, obj: Any) -> int:
        with self._lock:
            return self._seen.count(id(obj))


@pytest.fixture
def by_value_dumps(monkeypatch: pytest.MonkeyPatch) -> _ByValueDumps:
    counter = _ByValueDumps()
    real = pc_pickle._pickler.reduce_by_value

    def counting(obj: Any, *args: Any, **kwargs: Any) -> Any:
        counter.record(obj)
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(pc_pickle._pickler, "reduce_by_value", counting)
    return counter


@contextlib.contextmanager
def _pool(mode: str, processes: int = 2, **kwargs: Any) -> Iterator[Pool]:
    """A fork pool that copies (``mode="copy"``) or shares (``"share"``) tensors."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*multi-threaded.*fork.*", category=DeprecationWarning)
        pool = Pool(processes, is_copy_tensor=mode == "copy", share_method="cpu", **kwargs)
    with pool:
        yield pool


def test_pool_main_function_sharing_a_tensor_is_pickled_once(by_value_dumps: _ByValueDumps) -> None:
    script = _script()
    add_one = script["add_one"]
    t = torch.zeros(4)
    with _pool("share") as pool:
        for _ in range(20):
            assert pool.apply_async(add_one, (t,)).get(tu.T) is None
        pool.map(add_one, [t, t, t])
        # A closure over a tensor carries a share handle (one-shot): it is still dumped per job, and shares.
        buf = torch.zeros(2)
        write = script["make_writer"](buf)
        for _ in range(3):
            pool.apply(write, (1.0,))
    assert t.tolist() == [23.0] * 4  # every in-place add reached the caller's tensor
    assert buf.tolist() == [3.0, 3.0]
    assert by_value_dumps.of(add_one) == 1  # 21 jobs on 2 workers, one by-value pickle
    assert by_value_dumps.of(write) == 3


def test_pool_closure_is_pickled_once_for_repeated_jobs(by_value_dumps: _ByValueDumps) -> None:
    scale = _script()["make_scaler"](3)
    with _pool("copy") as pool:
        assert [pool.apply(scale, (i,)) for i in range(20)] == [3 * i for i in range(20)]
        assert pool.map(scale, range(10), chunksize=1) == [3 * i for i in range(10)]
    assert by_value_dumps.of(scale) == 1


# name -> (function of the script, the change, argument, result before, result after)
_CHANGES: dict[str, tuple[str, Callable[[dict[str, Any], Any], None], int, int, int]] = {
    "global rebound": ("scaled", lambda ns, f: ns.__setitem__("SCALE", 5), 1, 2, 5),
    "global of a helper": ("with_helper", lambda ns, f: ns.__setitem__("SCALE", 5), 1, 3, 6),
    "code of a helper": (
        "with_helper",
        lambda ns, f: setattr(ns["helper"], "__code__", _code("def h(x):\n    return x - 1\n")),
        1,
        3,
        1,
    ),
    "helper rebound": ("with_helper", lambda ns, f: ns.__setitem__("helper", abs), -4, -7, 5),
    "default": ("with_defaults", lambda ns, f: setattr(f, "__defaults__", (5,)), 1, 12, 20),
    "keyword default changed in place": (
        "with_defaults",
        lambda ns, f: f.__kwdefaults__.__setitem__("m", 1),
        1,
        12,
        3,
    ),
    "code": ("scaled", lambda ns, f: setattr(f, "__code__", _code("def h(x):\n    return -x\n")), 1, 2, -1),
    "builtin shadowed": ("absolute", lambda ns, f: ns.__setitem__("abs", lambda x: 42), -3, 3, 42),
    "closure cell": ("make_scaler", lambda ns, f: setattr(f.__closure__[0], "cell_contents", 7), 1, 3, 7),
}


@pytest.mark.parametrize("mode", ["copy", "share"])
@pytest.mark.parametrize("change", sorted(_CHANGES))
def test_pool_changed_function_is_pickled_again_and_seen_by_the_next_call(
    change: str, mode: str, by_value_dumps: _ByValueDumps
) -> None:
    name, mutate, x, before, after = _CHANGES[change]
    script = _script()
    func = script[name](3) if name == "make_scaler" else script[name]
    with _pool(mode) as pool:
        assert [pool.apply(func, (x,)) for _ in range(3)] == [before] * 3
        assert by_value_dumps.of(func) == 1
        mutate(script, func)
        assert [pool.apply(func, (x,)) for _ in range(3)] == [after] * 3
        assert pool.map(func, [x, x]) == [after] * 2
    assert by_value_dumps.of(func) == 2  # once more after the change, not per call


def test_pool_function_carrying_a_mutable_global_sees_it_change_in_place() -> None:
    script = _script()
    summed = script["summed"]
    with _pool("copy") as pool:
        got = []
        for value in range(5):
            script["CONFIG"].append(value)  # in place: no identity changes, so it is never cached
            got.append(pool.apply(summed, (0,)))
    assert got == [3, 4, 6, 9, 13]


@pytest.mark.parametrize("mode", ["copy", "share"])
def test_pool_replacement_workers_get_the_cached_function(mode: str, by_value_dumps: _ByValueDumps) -> None:
    whoami = _script()["make_whoami"](2)  # a closure of the script
    with _pool(mode, processes=1, maxtasksperchild=1) as pool:
        retired = [pool.apply(whoami, (i,)) for i in range(4)]  # each task on a new worker
    assert [value for _, value in retired] == [0, 2, 4, 6]
    assert len({pid for pid, _ in retired}) == 4
    with _pool(mode, processes=1) as pool:
        first_pid, value = pool.apply(whoami, (1,))
        assert value == 2
        with pytest.raises(WorkerDiedError):
            pool.apply_async(tu.kill_self).get(tu.T)
        new_pid, value = pool.apply_async(whoami, (5,)).get(tu.T)
        assert (new_pid != first_pid, value) == (True, 10)
    assert by_value_dumps.of(whoami) == 2  # once per pool: the payload reached five workers of the first


def test_pool_threads_submitting_changing_functions_get_their_own_results(
    by_value_dumps: _ByValueDumps,
) -> None:
    threads_n, rounds = 4, 30
    shared = _script()["make_scaler"](10)  # submitted by every thread, never changed
    scripts = [_script() for _ in range(threads_n)]
    start = threading.Barrier(threads_n)
    wrong: list[tuple[int, int, Any, Any]] = []

    def submit(i: int, pool: Pool) -> None:
        script, scaled = scripts[i], scripts[i]["scaled"]
        start.wait(tu.T)
        for r in range(rounds):
            if r % 3 == 0:
                script["SCALE"] = 100 * i + r  # this thread's own function changes every third round
            x = r + 1
            got = pool.apply_async(scaled, (x,)).get(tu.T)
            if got != x * script["SCALE"]:
                wrong.append((i, r, got, x * script["SCALE"]))
            got = pool.apply_async(shared, (x,)).get(tu.T)
            if got != 10 * x:
                wrong.append((i, r, got, 10 * x))

    with _pool("copy") as pool:
        workers = [threading.Thread(target=submit, args=(i, pool)) for i in range(threads_n)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(120)
        assert not any(w.is_alive() for w in workers)
    assert wrong == []
    # Each thread's function is pickled once per state it had; the shared one at most once per thread (the
    # threads may all miss the cache at once on their first call).
    assert [by_value_dumps.of(s["scaled"]) for s in scripts] == [rounds // 3] * threads_n
    assert 1 <= by_value_dumps.of(shared) <= threads_n


_Make = Callable[[dict[str, Any]], Any]
_Change = Callable[[dict[str, Any], Any], None]
# name -> (how to get the function from a fresh script, the change); None: no change
_SNAPSHOT_CASES: dict[str, tuple[_Make, _Change | None]] = {
    "unchanged": (lambda ns: ns["with_helper"], None),
    "unchanged closure": (lambda ns: ns["make_scaler"](3), None),
    "unchanged recursion": (lambda ns: ns["fact"], None),
    "unchanged type hints": (lambda ns: ns["annotated"], None),
    "global": (lambda ns: ns["scaled"], lambda ns, f: ns.__setitem__("SCALE", 7)),
    "global of a helper": (lambda ns: ns["with_helper"], lambda ns, f: ns.__setitem__("SCALE", 7)),
    "recursion rebound": (lambda ns: ns["fact"], lambda ns, f: ns.__setitem__("fact", abs)),
    "name": (lambda ns: ns["scaled"], lambda ns, f: setattr(f, "__name__", "other")),
    "qualname": (lambda ns: ns["scaled"], lambda ns, f: setattr(f, "__qualname__", "other")),
    "doc": (lambda ns: ns["scaled"], lambda ns, f: setattr(f, "__doc__", "documented")),
    "attribute": (lambda ns: ns["scaled"], lambda ns, f: setattr(f, "tag", 1)),
    "annotation in place": (lambda ns: ns["scaled"], lambda ns, f: f.__annotations__.__setitem__("x", int)),
    "keyword default": (lambda ns: ns["with_defaults"], lambda ns, f: setattr(f, "__kwdefaults__", {"m": 2})),
    "lambda's global": (lambda ns: eval("lambda x: x * SCALE", ns), lambda ns, f: ns.__setitem__("SCALE", 7)),
    "import the script shadows": (lambda ns: ns["whoami"], lambda ns, f: ns.__setitem__("os", "no module")),
}


@pytest.mark.parametrize("case", sorted(_SNAPSHOT_CASES))
def test_pool_snapshot_changes_with_what_the_payload_is_made_of(case: str) -> None:
    make, mutate = _SNAPSHOT_CASES[case]
    script = _script()
    func = make(script)
    before, payload = snapshot(func, False), pc_pickle.dumps(func)
    assert before is not None
    if mutate is None:
        # Unchanged: the same snapshot, and the same bytes (a worker reuses the function it loaded from them).
        assert same(before, snapshot(func, False) or [])
        assert pc_pickle.dumps(func) == payload
        return
    mutate(script, func)
    after = snapshot(func, False)
    assert after is None or not same(before, after)


def test_pool_functions_carrying_mutable_objects_have_no_snapshot() -> None:
    script = _script()
    assert snapshot(script["summed"], False) is None  # a list global
    assert snapshot(script["make_writer"](torch.zeros(1)), False) is None  # a tensor in a cell
    assert snapshot(script["boxed"], False) is None  # a class of the script (pickled by value)
    assert snapshot(eval("lambda x, d={}: d", script), False) is None  # a dict default
    assert snapshot(script["add_one"], False) is not None  # a plain function of the script
    assert snapshot(script["annotated"], False) is not None  # with defaults and type hints
    assert snapshot(tu.ident, False) == [tu.ident, False]  # found by name: its payload is the name


_FACTOR = 2
_MODULE_LAMBDA = lambda x: x * _FACTOR  # noqa: E731  # a lambda of an importable module (this one)


def test_pool_snapshot_holds_the_globals_of_an_importable_lambda_only_when_they_travel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    snaps = {recurse: snapshot(_MODULE_LAMBDA, recurse) for recurse in (False, True)}
    payloads = {recurse: pc_pickle.dumps(_MODULE_LAMBDA, recurse=recurse) for recurse in (False, True)}
    monkeypatch.setattr(sys.modules[__name__], "_FACTOR", 9)
    for recurse, snap in snaps.items():
        # Without recurse dill refers to this module's namespace by name: the worker looks _FACTOR up there.
        unchanged = pc_pickle.dumps(_MODULE_LAMBDA, recurse=recurse) == payloads[recurse]
        assert unchanged == (not recurse)
        assert snap is not None
        assert same(snap, snapshot(_MODULE_LAMBDA, recurse) or []) == unchanged
    # Globals that are not the namespace of the module the function names travel whole, by value.
    stray = eval("lambda x: x * SCALE", _script())
    stray.__module__ = __name__
    assert snapshot(stray, False) is None


def test_pool_function_payload_cache_is_bounded() -> None:
    dumps: list[Any] = []

    def dump(func: object) -> bytes:
        dumps.append(func)
        return pc_pickle.dumps(func)

    cache = FunctionPayloads(dump, recurse=False, size=8)
    funcs = [_script()["make_scaler"](k) for k in range(20)]
    for func in funcs:
        assert cache.payload(func) is not None
    assert len(cache._entries) == 8
    cache.payload(funcs[-1])  # still held
    cache.payload(funcs[0])  # pushed out: pickled again
    assert [dumps.count(f) for f in (funcs[-1], funcs[0])] == [1, 2]
    assert cache.payload(tu.CountingFunc()) is None  # not a plain function: never cached
