"""ModelAssigner: machin's seven cases with injected capacities (one exact answer each), edges, bad input."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch

from pc_assigner import InfeasiblePlacementError, ModelAssigner, PlacementProblem

KIB = 1024
MakeModule = Callable[[int], torch.nn.Module]


def _names(a: ModelAssigner) -> list[str]:
    return [str(d) for d in a.assignment]


def test_case1_complexity_weight_splits_connected_models(
    make_module: MakeModule, machin_settings: dict[str, Any]
) -> None:
    models = [make_module(10 * KIB), make_module(10 * KIB)]
    a = ModelAssigner(models, {(0, 1): 1}, **machin_settings)
    assert _names(a) == ["cuda:0", "cuda:1"]
    assert a.result.method == "exact"
    assert a.result.optimal


def test_case2_connection_weight_keeps_them_together(
    make_module: MakeModule, machin_settings: dict[str, Any]
) -> None:
    settings = {**machin_settings, "connection_weight": 10, "complexity_match_weight": 1}
    a = ModelAssigner([make_module(10 * KIB), make_module(10 * KIB)], {(0, 1): 1}, **settings)
    assert _names(a) == ["cuda:0", "cuda:0"]


def test_case3_too_large_for_one_gpu_are_split(
    make_module: MakeModule, machin_settings: dict[str, Any]
) -> None:
    a = ModelAssigner([make_module(600 * KIB), make_module(600 * KIB)], {(0, 1): 1}, **machin_settings)
    assert _names(a) == ["cuda:0", "cuda:1"]
    assert all(m <= c for m, c in zip(a.result.cost.memory, a.problem.capacities, strict=True))


def test_case4_one_gpu_takes_both(make_module: MakeModule, machin_settings: dict[str, Any]) -> None:
    settings = {
        **machin_settings,
        "devices": ["cuda:0", "cpu"],
        "device_memory": {"cuda:0": 1000 * KIB, "cpu": 1000 * KIB},
    }
    a = ModelAssigner([make_module(10 * KIB), make_module(10 * KIB)], {(0, 1): 1}, **settings)
    assert _names(a) == ["cuda:0", "cuda:0"]


def test_case5_no_gpu_means_cpu(make_module: MakeModule, machin_settings: dict[str, Any]) -> None:
    settings = {**machin_settings, "devices": ["cpu"], "device_memory": [1000 * KIB], "move_models": True}
    models = [make_module(10 * KIB), make_module(10 * KIB)]
    a = ModelAssigner(models, {(0, 1): 1}, **settings)
    assert _names(a) == ["cpu", "cpu"]


def test_case6_default_devices_without_gpu(make_module: MakeModule, machin_settings: dict[str, Any]) -> None:
    settings = {**machin_settings, "devices": None, "device_memory": {"cpu": 1000 * KIB}}
    with (
        mock.patch("torch.cuda.is_available", return_value=False),
        mock.patch("torch.cuda.device_count", return_value=0),
    ):
        a = ModelAssigner([make_module(10 * KIB), make_module(10 * KIB)], {(0, 1): 1}, **settings)
    assert _names(a) == ["cpu", "cpu"]
    assert a.devices == [torch.device("cpu")]


def test_case7_too_large_for_everything(make_module: MakeModule, machin_settings: dict[str, Any]) -> None:
    settings = {**machin_settings, "devices": ["cuda:0", "cpu"], "device_memory": [10 * KIB, 10 * KIB]}
    with pytest.raises(
        RuntimeError, match=r"Estimated model will use 0\.20 MiB, but only have 0\.01 MiB"
    ) as info:
        ModelAssigner([make_module(100 * KIB), make_module(100 * KIB)], {(0, 1): 1}, **settings)
    assert isinstance(info.value, InfeasiblePlacementError)
    assert info.value.proven


def test_model_larger_than_every_device_is_named(
    make_module: MakeModule, machin_settings: dict[str, Any]
) -> None:
    # the total fits (machin only checked this) but model 1 fits on no single device
    settings = {**machin_settings, "device_memory": [100 * KIB, 100 * KIB, 100 * KIB]}
    with pytest.raises(RuntimeError, match=r"model 1 will use 0.10 MiB, more than any device allows"):
        ModelAssigner([make_module(10 * KIB), make_module(100 * KIB)], {}, **settings)


def test_cpu_weight_zero_keeps_work_off_the_cpu(
    make_module: MakeModule, machin_settings: dict[str, Any]
) -> None:
    settings = {**machin_settings, "cpu_weight": 0}
    models = [make_module(10 * KIB) for _ in range(5)]
    a = ModelAssigner(models, {}, **settings)
    assert "cpu" not in _names(a)
    # and when the GPUs cannot hold everything, that is an error rather than a silent spill to the CPU
    settings["device_memory"] = [20 * KIB, 20 * KIB, 1000 * KIB]
    with pytest.raises(RuntimeError, match=r"on \['cuda:0', 'cuda:1'\]"):
        ModelAssigner(models, {}, **settings)


def test_cpu_only_with_zero_weight_and_empty_connections(make_module: MakeModule) -> None:
    # machin: NaN from 0/0 and D/sum(D), everything to device 0; here a finite, feasible answer
    a = ModelAssigner(
        [make_module(KIB), make_module(KIB)],
        {},
        devices=["cpu"],
        device_memory=[100 * KIB],
        move_models=False,
    )
    assert _names(a) == ["cpu", "cpu"]
    assert math.isfinite(a.result.cost.total)
    one = ModelAssigner(
        [make_module(KIB)], {}, devices=["cuda:0"], device_memory=[100 * KIB], move_models=False
    )
    assert _names(one) == ["cuda:0"]
    none = ModelAssigner([], {}, devices=["cuda:0"], device_memory=[100 * KIB], move_models=False)
    assert none.assignment == []


def test_gradient_method_is_seeded_finite_and_feasible(
    make_module: MakeModule, machin_settings: dict[str, Any]
) -> None:
    settings = {
        **machin_settings,
        "method": "gradient",
        "iterations": 50,
        "device_memory": [700 * KIB, 700 * KIB, 1e9],
    }
    models = [make_module(s * KIB) for s in (300, 300, 200, 200)]
    runs = [ModelAssigner(models, {(0, 1): 1, (1, 2): 1}, **settings, seed=3) for _ in range(2)]
    assert _names(runs[0]) == _names(runs[1])
    assert runs[0].result.cost.feasible
    assert math.isfinite(runs[0].result.cost.total)


def test_tied_models_are_co_located_and_counted_once(
    make_module: MakeModule, machin_settings: dict[str, Any]
) -> None:
    shared = torch.nn.Linear(64, 64)
    m0 = torch.nn.Sequential(shared, torch.nn.ReLU())
    m1 = torch.nn.Sequential(torch.nn.Linear(64, 64), shared)
    m2 = make_module(16 * KIB)
    a = ModelAssigner([m0, m1, m2], {}, **machin_settings)
    assert a.groups == [[0, 1], [2]]
    assert a.assignment[0] == a.assignment[1]
    assert a.problem.sizes[0] == 2 * (64 * 64 + 64) * 4  # the shared Linear once, plus m1's own


def test_move_models_true_moves_and_false_leaves_alone(make_module: MakeModule) -> None:
    model = make_module(KIB)
    with mock.patch.object(model, "to", wraps=model.to) as to:
        ModelAssigner([model], {}, devices=["cpu"], device_memory=[10 * KIB], move_models=False)
        to.assert_not_called()
        ModelAssigner([model], {}, devices=["cpu"], device_memory=[10 * KIB])
        to.assert_called_once_with(torch.device("cpu"))


def test_model_complexity_numbers_and_example_inputs(make_module: MakeModule) -> None:
    # the small models carry the work: with sizes as the proxy they would share a device with the big one
    models = [make_module(400 * KIB), make_module(4 * KIB), make_module(4 * KIB)]
    base = {"devices": ["cuda:0", "cuda:1"], "device_memory": [4 * 10**6, 4 * 10**6], "move_models": False}
    by_size = ModelAssigner(models, {}, **base)
    by_work = ModelAssigner(models, {}, **base, model_complexity=[1, 50, 50])
    assert _names(by_size) == ["cuda:0", "cuda:1", "cuda:1"]
    assert _names(by_work) == ["cuda:0", "cuda:0", "cuda:1"]
    lins = [torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False)]
    flops = ModelAssigner(lins, {}, **base, model_complexity=[(torch.zeros(4, 8),), (torch.zeros(40, 8),)])
    assert flops.problem.compute == (4 * 4 * 8 * 8, 4 * 40 * 8 * 8)
    assert flops.problem.sizes[0] == 4 * 8 * 8 * 4 + 4 * 8 * 4  # P + G + 2G + activations


def test_device_speed_steers_work(make_module: MakeModule) -> None:
    models = [make_module(KIB) for _ in range(4)]
    a = ModelAssigner(
        models,
        {},
        devices=["cuda:0", "cuda:1"],
        device_memory=[10**6, 10**6],
        move_models=False,
        device_speed={"cuda:0": 3.0, "cuda:1": 1.0},
    )
    assert _names(a).count("cuda:0") == 3


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"model_connection": {(0, 5): 1}}, ValueError, r"out of range"),
        ({"model_connection": {(1, 1): 1}}, ValueError, r"to itself"),
        ({"model_connection": {(0, 1): -1}}, ValueError, r"non-negative"),
        ({"model_connection": {(0, 1): math.nan}}, ValueError, r"finite"),
        ({"model_connection": {0: 1}}, TypeError, r"\(int, int\) pairs"),
        ({"model_connection": [(0, 1)]}, TypeError, r"mapping"),
        ({"devices": "cpu"}, TypeError, r"list of devices"),
        ({"devices": []}, ValueError, r"at least one device"),
        ({"devices": ["cpu", "cpu"]}, ValueError, r"distinct"),
        ({"devices": ["nonsense"]}, ValueError, r"not a device"),
        ({"device_memory": {"cuda:3": 1}}, ValueError, r"not among the devices"),
        ({"device_memory": [1]}, ValueError, r"one entry per device"),
        ({"device_memory": {"cpu": -1}}, ValueError, r">= 0"),
        ({"max_mem_ratio": 0}, ValueError, r"max_mem_ratio"),
        ({"max_mem_ratio": 1.5}, ValueError, r"\(0, 1\]"),
        ({"method": "magic"}, ValueError, r"method must be one of"),
        ({"model_complexity": [1]}, ValueError, r"one entry per model"),
        ({"model_complexity": [1, (torch.zeros(1),)]}, TypeError, r"not a mix"),
        ({"cpu_weight": -1}, ValueError, r"cpu_weight"),
        ({"models": [torch.nn.Linear(1, 1), "x"]}, TypeError, r"models\[1\]"),
    ],
)
def test_bad_input(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    args: dict[str, Any] = {
        "models": [torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)],
        "model_connection": {(0, 1): 1},
        "devices": ["cuda:0", "cpu"],
        "device_memory": {"cuda:0": 10**6, "cpu": 10**6},
        "move_models": False,
    }
    args.update(kwargs)
    with pytest.raises(error, match=match):
        ModelAssigner(**args)


def test_probing_a_missing_gpu_says_what_to_do() -> None:
    with (
        mock.patch("torch.cuda.is_available", return_value=False),
        pytest.raises(ValueError, match="device_memory"),
    ):
        ModelAssigner([torch.nn.Linear(1, 1)], {}, devices=["cuda:0"], move_models=False)


def test_cpu_memory_is_probed_when_not_given() -> None:
    a = ModelAssigner([torch.nn.Linear(4, 4)], {}, devices=["cpu"], move_models=False)
    assert a.problem.capacities[0] > 0
    assert isinstance(a.problem, PlacementProblem)
