"""Deterministic, memory-safe placement of PyTorch modules on devices.

``ModelAssigner`` places models on devices under hard memory limits, minimising the slowest
device's compute time plus communication; ``ModelSizeEstimator`` counts their bytes (every dtype, shared
storage once) and, from example inputs, activations and FLOPs. The solver core is pure and usable on its own:
``PlacementProblem`` -> ``solve_placement`` -> ``PlacementResult``.
"""

from pc_assigner.__about__ import __version__
from pc_assigner.assigner import DeviceLike, ModelAssigner
from pc_assigner.errors import InfeasiblePlacementError
from pc_assigner.estimator import MIB, ModelSizeEstimator, SizeRequirements
from pc_assigner.problem import PlacementCost, PlacementProblem, placement_cost
from pc_assigner.solve import AUTO_EXACT_LIMIT, METHODS, PlacementResult, solve_placement

__all__ = [
    "AUTO_EXACT_LIMIT",
    "METHODS",
    "MIB",
    "DeviceLike",
    "InfeasiblePlacementError",
    "ModelAssigner",
    "ModelSizeEstimator",
    "PlacementCost",
    "PlacementProblem",
    "PlacementResult",
    "SizeRequirements",
    "__version__",
    "placement_cost",
    "solve_placement",
]
