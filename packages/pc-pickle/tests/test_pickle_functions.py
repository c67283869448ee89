"""Functions and classes: lambdas, closures, local classes, recurse, __main__ code, static modules."""

from __future__ import annotations

import importlib
import inspect
import os
import pickle
import subprocess
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import pc_pickle

pytestmark = pytest.mark.filterwarnings("error")

GLOBAL_OFFSET = 10


def _round_trip(obj: object, **kwargs: bool) -> object:
    return pc_pickle.loads(pc_pickle.dumps(obj, **kwargs))


def test_lambda_and_closure_over_tensor() -> None:
    weight = torch.arange(3.0)

    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * weight

    loaded = _round_trip({"lam": lambda x: x + 1, "scale": scale, "weight": weight})
    assert isinstance(loaded, dict)
    assert loaded["lam"](1) == 2
    assert torch.equal(loaded["scale"](torch.ones(3)), weight)
    # The closure's tensor and the graph's tensor share one storage (one table per payload).
    cell_tensor = loaded["scale"].__closure__[0].cell_contents
    assert cell_tensor.untyped_storage().data_ptr() == loaded["weight"].untyped_storage().data_ptr()


def test_closure_over_shared_tensor_aliases() -> None:
    acc = torch.zeros(2)
    loaded = _round_trip(lambda: acc.add_(1), copy_tensor=False)
    assert callable(loaded)
    loaded()
    assert torch.equal(acc, torch.ones(2))


def test_local_class_instances_and_bound_methods() -> None:
    class Counter:
        def __init__(self, start: int) -> None:
            self.value = start

        def bump(self) -> int:
            self.value += 1
            return self.value

    counter = Counter(4)
    out_counter, out_bump, out_cls = _round_trip([counter, counter.bump, Counter])  # type: ignore[misc]
    assert type(out_counter).__name__ == "Counter"
    assert out_counter.value == 4
    assert out_bump() == 5
    assert out_cls(1).bump() == 2


def test_importable_functions_go_by_reference() -> None:
    data = pc_pickle.dumps([torch.add, _round_trip, inspect.getfile])
    assert b"dill" not in data
    assert _round_trip([torch.add, _round_trip]) == [torch.add, _round_trip]


def test_recurse_carries_globals_by_value() -> None:
    fn = eval("lambda x: x + GLOBAL_OFFSET", {"GLOBAL_OFFSET": 5})  # globals are not a module's
    assert callable(fn)
    assert _round_trip(fn, recurse=True)(1) == 6  # type: ignore[operator]
    here = _round_trip(lambda x: x + GLOBAL_OFFSET)  # recurse=False: looked up in this module on load
    assert here(1) == 11  # type: ignore[operator]


def test_nn_module_with_lambda_attribute() -> None:
    model = torch.nn.Linear(3, 2)
    model.activation = lambda x: x.relu()  # type: ignore[assignment]
    loaded = _round_trip(model)
    assert isinstance(loaded, torch.nn.Linear)
    x = torch.randn(4, 3)
    assert torch.equal(loaded.activation(loaded(x)), model(x).relu())  # type: ignore[operator]


@pytest.fixture
def cdll_module(tmp_path: Path) -> Iterator[types.ModuleType]:
    """A module imported from a directory on sys.path, outside site-packages, that holds a ctypes.CDLL.

    dill's own rule pickles such a module by value (its file is outside ``sys.prefix`` and site-packages), and
    the CDLL cannot be pickled; so does a source checkout on ``PYTHONPATH`` or an editable install.
    """
    name = f"pickle_cdll_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text("import ctypes\nLIB = ctypes.CDLL(None)\nVALUE = 41\n")
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


def test_importable_modules_outside_site_packages_go_by_reference(cdll_module: types.ModuleType) -> None:
    mod = cdll_module
    assert "site-packages" not in str(mod.__file__)

    def reader() -> int:
        return int(mod.VALUE) + 1

    referencing = lambda: mod.VALUE  # noqa: E731
    for fn, expected in ((reader, 42), (referencing, 41)):
        for recurse in (False, True):
            loaded = _round_trip(fn, recurse=recurse)  # by value, the CDLL global refused to pickle
            assert callable(loaded)
            assert loaded() == expected
            assert loaded.__closure__[0].cell_contents is mod  # type: ignore[attr-defined]


_CHECKOUT_SENDER = textwrap.dedent(
    """
    import sys, pc_pickle
    import checkout_mod as cm
    cm.STATE["who"] = "sender"  # a change the loader must not receive: its own module is the one it uses
    sys.stdout.buffer.write(pc_pickle.dumps([cm.__file__, pc_pickle.dumps(lambda: cm.whoami())]))
    """
)
_CHECKOUT_LOADER = textwrap.dedent(
    """
    import sys, pc_pickle
    import checkout_mod as cm
    cm.STATE["who"] = "loader"
    fn = pc_pickle.loads(sys.stdin.buffer.read())
    sys.stdout.buffer.write(pc_pickle.dumps([fn(), cm.STATE["who"], fn.__globals__["cm"] is cm]))
    """
)


def test_a_main_lambda_refers_to_a_checkout_module_by_name(tmp_path: Path) -> None:
    # a module found on PYTHONPATH (a source checkout, an editable install): by value it dragged its globals
    # along and, on load, wrote the sender's globals over the loader's own module
    (tmp_path / "checkout_mod.py").write_text(
        "import threading\nLOCK = threading.Lock()\nSTATE = {'who': 'import'}\n"
        "def whoami():\n    return STATE['who']\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}

    def python(code: str, stdin: bytes) -> bytes:
        done = subprocess.run(
            [sys.executable, "-c", code], input=stdin, env=env, capture_output=True, timeout=60, check=False
        )
        assert done.returncode == 0, done.stderr.decode()
        return done.stdout

    where, payload = pc_pickle.loads(python(_CHECKOUT_SENDER, b""))
    assert Path(where).parent == tmp_path  # outside site-packages and sys.prefix
    assert pc_pickle.loads(python(_CHECKOUT_LOADER, payload)) == ["loader", "loader", True]


@pytest.fixture
def specless_cdll_module(tmp_path: Path) -> Iterator[types.ModuleType]:
    """A module made at run time (no ``__spec__``) from a file outside site-packages, holding a ctypes.CDLL.

    The import system did not find it, so pc_pickle leaves it to dill, which pickles it by value.
    """
    name = f"pickle_specless_{tmp_path.name.replace('-', '_')}"
    path = tmp_path / f"{name}.py"
    path.write_text("import ctypes\nLIB = ctypes.CDLL(None)\nVALUE = 41\n")
    mod = types.ModuleType(name)
    mod.__file__ = str(path)
    exec(compile(path.read_text(), str(path), "exec"), mod.__dict__)
    sys.modules[name] = mod
    try:
        yield mod
    finally:
        sys.modules.pop(name, None)


@pytest.mark.filterwarnings("ignore::dill.PicklingWarning")
def test_mark_static_module_twice(specless_cdll_module: types.ModuleType) -> None:
    mod = specless_cdll_module

    def reader() -> int:
        return int(mod.VALUE) + 1

    with pytest.raises(pickle.PicklingError):
        pc_pickle.dumps(reader)  # by value: the CDLL cannot be pickled
    pc_pickle.mark_static_module(mod)
    pc_pickle.mark_static_module(mod)  # idempotent
    loaded = _round_trip(reader)
    assert loaded() == 42  # type: ignore[operator]
    assert loaded.__closure__[0].cell_contents is mod  # type: ignore[attr-defined]
    assert mod.__file__.endswith(".py")  # the module was not mutated


def test_mark_static_module_rejects_non_modules() -> None:
    with pytest.raises(TypeError, match="expects a module object, got str"):
        pc_pickle.mark_static_module("os")  # type: ignore[arg-type]


_PRODUCER = textwrap.dedent(
    """
    import sys, torch, pc_pickle
    SCALE = 3
    def scaled(x):
        return x * SCALE + BIAS.item()
    BIAS = torch.tensor(0.5)
    sys.stdout.buffer.write(pc_pickle.dumps([pc_pickle.dumps(scaled, recurse=True),
                                             pc_pickle.dumps(scaled, recurse=False)]))
    """
)
_CONSUMER = textwrap.dedent(
    """
    import copyreg, sys, warnings, dill, torch, torch.multiprocessing as tmp
    from multiprocessing.reduction import ForkingPickler
    def snapshot():
        return (tmp.get_sharing_strategy(), dict(ForkingPickler._extra_reducers),
        dict(copyreg.dispatch_table),
                dict(dill.settings), list(warnings.filters), dict(dill.Pickler.dispatch))
    before = snapshot()
    import pc_pickle
    with_globals, without = pc_pickle.loads(sys.stdin.buffer.read())
    fn = pc_pickle.loads(with_globals)
    try:
        outcome = pc_pickle.loads(without)(2)
    except NameError as exc:
        outcome = "NameError"
    repickled = pc_pickle.dumps(fn, recurse=True)
    unchanged = snapshot() == before
    sys.stdout.buffer.write(pc_pickle.dumps([fn(2), outcome, repickled, unchanged]))
    """
)


def _python(code: str, stdin: bytes) -> bytes:
    done = subprocess.run(
        [sys.executable, "-c", code], input=stdin, capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout


def test_main_function_in_fresh_interpreter_and_import_hygiene() -> None:
    payload = _python(_PRODUCER, b"")
    value, outcome, repickled, unchanged = pc_pickle.loads(_python(_CONSUMER, payload))
    # Importing pc_pickle, loading and dumping changed no global table, setting, strategy or warning filter.
    assert unchanged
    assert value == 6.5  # recurse=True carried SCALE and BIAS
    # recurse=False too: __main__ code carries the globals it references by value (issue 16; before, they
    # were looked up in the loader's __main__, another script, and gave NameError as in dill#126).
    assert outcome == 6.5
    fn = pc_pickle.loads(repickled)
    assert fn(4) == 12.5


_SPAWNED_SCRIPT = textwrap.dedent(
    """
    import ctypes, multiprocessing, sys
    import pc_pickle

    OFFSET = 100
    POINTER = ctypes.pointer(ctypes.c_int(1))  # a global that cannot be pickled

    def job():
        # runs in a spawned process, where this script is the module __mp_main__
        scale = 3

        class Shifted:  # a local class: by value, its method's globals with it
            def __call__(self, x):
                return x + OFFSET + scale

        made = {
            "closure": lambda x: x * scale,
            "global": lambda x: x + OFFSET,
            "plain": lambda x: -x,
            "class": Shifted(),
        }
        return __name__, {name: pc_pickle.dumps(fn) for name, fn in made.items()}

    if __name__ == "__main__":
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            module, dumped = pool.apply_async(job).get(timeout=60)
        fns = {name: pc_pickle.loads(data) for name, data in dumped.items()}
        sys.stdout.buffer.write(pc_pickle.dumps((module, {name: fn(2) for name, fn in fns.items()})))
    """
)


def test_lambdas_of_a_spawned_process_main_module_carry_only_what_they_reference(tmp_path: Path) -> None:
    # run_world and torch.multiprocessing start ranks with spawn: the script runs there as __mp_main__, and a
    # lambda defined in it used to carry that module's whole namespace (here an unpicklable pointer) and fail
    script = tmp_path / "spawned_main.py"
    script.write_text(_SPAWNED_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, timeout=120, check=False, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr.decode()
    module, values = pc_pickle.loads(done.stdout)
    assert module == "__mp_main__"
    assert values == {"closure": 6, "global": 102, "plain": -2, "class": 105}


def test_functions_in_containers_share_one_dill_payload() -> None:
    fn: Callable[[int], int] = lambda x: x  # noqa: E731
    data = pc_pickle.dumps([fn] * 50)
    assert len(data) < 2 * len(pc_pickle.dumps([fn]))
    out = pc_pickle.loads(data)
    assert all(f is out[0] for f in out)


def _top_level_add(x: int) -> int:
    return x + 1


def test_the_by_value_rules_are_what_dumps_follows() -> None:
    """``needs_by_value``/``imported_by_name`` say what a payload depends on: by name, or its value."""

    def local(x: int) -> int:
        return x

    for fn, by_value in ((_top_level_add, False), (os.path.join, False), (local, True), (lambda: 0, True)):
        assert pc_pickle.needs_by_value(fn) is by_value, fn
        # by name the round trip gives the object itself; by value a copy of it
        assert (_round_trip(fn) is fn) is not by_value, fn
    assert pc_pickle.needs_by_value(type("Made", (), {}))  # not found under its own name
    assert pc_pickle.imported_by_name(os)
    made = types.ModuleType("made_at_run_time")
    assert not pc_pickle.imported_by_name(made)
    assert pickle.loads(pc_pickle.dumps(os)) is os
