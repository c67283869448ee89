"""``ModelAssigner``: the original placement API as a thin adapter over the pure solver.

::

    devices, device_memory, device_speed ──> capacities (x max_mem_ratio), speeds, distances
    models (+ model_complexity) ──> sizes / FLOPs, merged into items where models share a storage
    model_connection ──> traffic between items
                         └──> PlacementProblem(alpha, beta from the weights)    ──> solve_placement
                                                                                    └──> model.to(device)

The weights keep their meaning: ``complexity_match_weight`` scales the makespan and ``connection_weight``
the communication, each divided by an instance constant so that neither depends on units: the perfectly
balanced makespan ``T0 = sum(compute) / sum(speeds)`` and the traffic of a locality-blind placement
``C0 = sum(traffic) * mean distance between distinct devices``. A zero constant drops its term.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pc_assigner._checks import int_at_least
from pc_assigner._gd import optimize_placement as _optimize_placement
from pc_assigner._inputs import DeviceLike, check_number, per_device, to_device
from pc_assigner._items import check_memory, sizes_and_compute, storage_groups
from pc_assigner._probe import default_devices, probe_memory
from pc_assigner._sizing import storage_key
from pc_assigner.estimator import MIB
from pc_assigner.problem import PlacementProblem, normalize_traffic
from pc_assigner.solve import METHODS, Method, PlacementResult, solve_placement

__all__ = ["DeviceLike", "ModelAssigner"]

logger = logging.getLogger(__name__)


class ModelAssigner:
    """Assign PyTorch modules to devices within one process, under hard memory limits.

    The placement minimises ``complexity_match_weight / T0 * makespan + connection_weight / C0 * traffic x
    distance`` (see the module docstring) subject to every device's memory limit. It is proven optimal by
    exhaustive search when ``m ** n <= 4096`` (m usable devices, n models after merging models that share
    storage) and by branch and bound above that, within its node budget; beyond the budget (or 48 items) the
    best of branch and bound and of greedy construction plus local search with seeded restarts is taken
    (``result.optimal`` says which). The result is deterministic for a ``seed``.

    Args:
        models: Models to assign.
        model_connection: ``{(i, j): w}``, traffic from model i to model j per step (any consistent unit).
        devices: Devices to use; ``None`` means every visible CUDA device plus the CPU.
        model_size_multiplier: Model memory = (parameters + buffers) x this (unless ``model_complexity`` gives
            example inputs, then the training estimate P + B + G + O + A is used instead).
        max_mem_ratio: Fraction of each device's free memory that may be used, in (0, 1].
        cpu_weight: Speed of the CPU relative to one GPU; 0 means "never compute on the CPU" (it is then left
            out unless it is the only kind of device).
        connection_weight: Weight of communication.
        size_match_weight: Used only by ``method="gradient"`` (memory is a hard limit otherwise).
        complexity_match_weight: Weight of compute balance (the makespan).
        entropy_weight: Used only by ``method="gradient"``.
        iterations: Used only by ``method="gradient"``.
        update_rate: Used only by ``method="gradient"``.
        gpu_gpu_distance: Distance between two GPUs.
        cpu_gpu_distance: Distance between the CPU and a GPU.
        move_models: Call ``model.to(device)`` on each model after assignment.
        device_memory: Free bytes per device (a mapping or a list aligned with ``devices``); replaces the
            probe for the devices it names, and ``max_mem_ratio`` still applies. With it, ``cuda:*``
            placements can be planned on a machine without GPUs (use ``move_models=False``).
        device_speed: Relative throughput per device (mapping or list); default 1.0 per accelerator and
            ``cpu_weight`` for the CPU.
        model_complexity: Compute per model: numbers, or one tuple of example inputs per model, from which
            forward + backward FLOPs are counted on the meta device. Default: the model size (a proxy).
        seed: Seed of the heuristic's restarts and of the gradient method's start.
        method: ``"auto"``, ``"exact"``, ``"bnb"``, ``"ilp"`` (needs scipy), ``"heuristic"``, ``"greedy"`` or
            ``"gradient"`` (a gradient surrogate, repaired to feasibility; not recommended).

    Raises:
        TypeError: for arguments of the wrong type.
        ValueError: for bad values (connection indices, negative weights, unknown devices or methods, ...).
        InfeasiblePlacementError: (a ``RuntimeError``) when the models cannot fit: ``"Estimated model will use
            X MiB, but only have Y MiB allowed memory in total."``, or a model larger than every device.

    Examples:
        >>> a = ModelAssigner([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)], {(0, 1): 1},
        ...                   devices=["cuda:0", "cuda:1"], device_memory=[2**30, 2**30], move_models=False)
        >>> [str(d) for d in a.assignment]
        ['cuda:0', 'cuda:1']
    """

    def __init__(
        self,
        models: Sequence[torch.nn.Module],
        model_connection: Mapping[tuple[int, int], float],
        devices: Sequence[DeviceLike] | None = None,
        model_size_multiplier: float = 2,
        max_mem_ratio: float = 0.5,
        cpu_weight: float = 0,
        connection_weight: float = 2,
        size_match_weight: float = 0.01,
        complexity_match_weight: float = 1,
        entropy_weight: float = 1,
        iterations: int = 500,
        update_rate: float = 0.01,
        gpu_gpu_distance: float = 1,
        cpu_gpu_distance: float = 10,
        move_models: bool = True,
        *,
        device_memory: Mapping[DeviceLike, float] | Sequence[float] | None = None,
        device_speed: Mapping[DeviceLike, float] | Sequence[float] | None = None,
        model_complexity: Sequence[float | tuple[Any, ...]] | None = None,
        seed: int = 0,
        method: Method = "auto",
    ) -> None:
        if isinstance(models, torch.nn.Module) or not isinstance(models, Sequence):
            raise TypeError(f"models must be a sequence of torch.nn.Module, got {type(models).__name__}")
        for i, mdl in enumerate(models):
            if not isinstance(mdl, torch.nn.Module):
                raise TypeError(f"models[{i}] must be a torch.nn.Module, got {type(mdl).__name__}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        int_at_least("iterations", iterations, 0)
        ratio = check_number("max_mem_ratio", max_mem_ratio, positive=True)
        if ratio > 1:
            raise ValueError(f"max_mem_ratio must be in (0, 1], got {max_mem_ratio!r}")
        multiplier = check_number("model_size_multiplier", model_size_multiplier)
        cpu_w = check_number("cpu_weight", cpu_weight)
        conn_w = check_number("connection_weight", connection_weight)
        cmplx_w = check_number("complexity_match_weight", complexity_match_weight)
        gg = check_number("gpu_gpu_distance", gpu_gpu_distance)
        cg = check_number("cpu_gpu_distance", cpu_gpu_distance)
        n_models = len(models)
        edges = normalize_traffic(model_connection, n_models, name="model_connection")

        if isinstance(devices, (str, torch.device, int)) or not (
            devices is None or isinstance(devices, Sequence)
        ):
            raise TypeError(
                f"devices must be None or a list of devices, got {type(devices).__name__} ({devices!r})"
            )
        devs = default_devices() if devices is None else [to_device(d) for d in devices]
        if not devs:
            raise ValueError("devices must name at least one device, got an empty list")
        if len(set(devs)) != len(devs):
            raise ValueError(f"devices must be distinct, got {[str(d) for d in devs]}")
        memory = per_device("device_memory", device_memory, devs)
        speed = per_device("device_speed", device_speed, devs)
        free = [memory[d] if d in memory else float(probe_memory(d)) for d in devs]
        caps = [f * ratio for f in free]
        speeds = [speed.get(d, cpu_w if d.type == "cpu" else 1.0) for d in devs]
        dist = [
            [0.0 if a == b else (cg if (a.type == "cpu") != (b.type == "cpu") else gg) for b in devs]
            for a in devs
        ]

        # -- items: models that share a storage are merged so tied weights stay on one device ------------
        keysets = [{storage_key(t) for t in [*mdl.parameters(), *mdl.buffers()]} for mdl in models]
        groups = storage_groups(keysets)
        item_of = [0] * n_models
        for g, members in enumerate(groups):
            for i in members:
                item_of[i] = g
        sizes, compute = sizes_and_compute(models, groups, multiplier, model_complexity)
        traffic: dict[tuple[int, int], float] = {}
        for i, k, w in edges:
            a, b = item_of[i], item_of[k]
            if a != b:
                traffic[(a, b)] = traffic.get((a, b), 0.0) + w

        base = PlacementProblem(
            sizes=tuple(sizes),
            compute=tuple(compute),
            capacities=tuple(caps),
            speeds=tuple(speeds),
            distance=tuple(tuple(r) for r in dist),
            traffic=tuple((a, b, w) for (a, b), w in sorted(traffic.items())),
        )
        usable = base.eligible
        check_memory(base, groups, devs)
        t0 = sum(compute) / sum(base.effective_speeds[j] for j in usable)
        pair_d = [dist[a][b] for a in usable for b in usable if a != b]
        c0 = sum(traffic.values()) * (sum(pair_d) / len(pair_d) if pair_d else 0.0)
        problem = PlacementProblem(
            sizes=base.sizes,
            compute=base.compute,
            capacities=base.capacities,
            speeds=base.speeds,
            distance=base.distance,
            traffic=base.traffic,
            alpha=cmplx_w / t0 if t0 > 0 else 0.0,
            beta=conn_w / c0 if c0 > 0 else 0.0,
        )
        result = solve_placement(
            problem,
            method=method,
            seed=seed,
            gradient_options={
                "iterations": iterations,
                "update_rate": check_number("update_rate", update_rate),
                "connection_weight": conn_w,
                "size_match_weight": check_number("size_match_weight", size_match_weight),
                "complexity_match_weight": cmplx_w,
                "entropy_weight": check_number("entropy_weight", entropy_weight),
                "size_unit": float(MIB),
            },
        )
        self._devices = devs
        self._problem = problem
        self._result = result
        self._groups = groups
        self._assignment = [devs[result.assignment[item_of[i]]] for i in range(n_models)]
        logger.debug(
            "assigned %d models (%d items) to %s by %s: makespan=%g communication=%g",
            n_models,
            len(groups),
            [str(d) for d in self._assignment],
            result.method,
            result.cost.makespan,
            result.cost.communication,
        )
        if move_models:
            for mdl, dev in zip(models, self._assignment, strict=True):
                mdl.to(dev)

    @property
    def assignment(self) -> list[torch.device]:
        """List[torch.device]: Assigned device of each model in your model list."""
        return list(self._assignment)

    @property
    def devices(self) -> list[torch.device]:
        """The devices that were considered, in order."""
        return list(self._devices)

    @property
    def problem(self) -> PlacementProblem:
        """The solved instance (items are groups of models sharing storage, see :attr:`groups`)."""
        return self._problem

    @property
    def groups(self) -> list[list[int]]:
        """Model indices merged into each item because they share a parameter or buffer storage."""
        return [list(g) for g in self._groups]

    @property
    def result(self) -> PlacementResult:
        """The placement with its cost breakdown, method and optimality proof."""
        return self._result

    optimize_placement = staticmethod(_optimize_placement)
