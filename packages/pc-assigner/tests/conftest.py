"""Fixtures of the pc-assigner tests: modules of an exact byte size and the machin cases' settings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

KIB = 1024


def module_of(nbytes: int) -> torch.nn.Module:
    """A module holding one float32 parameter of exactly ``nbytes`` bytes."""
    m = torch.nn.Module()
    m.register_parameter("w", torch.nn.Parameter(torch.zeros(nbytes // 4)))
    return m


@pytest.fixture
def make_module() -> Callable[[int], torch.nn.Module]:
    return module_of


@pytest.fixture
def machin_settings() -> dict[str, Any]:
    """machin's test settings (sizes there were MB; here KiB, which unit invariance makes equivalent)."""
    return {
        "devices": ["cuda:0", "cuda:1", "cpu"],
        "model_size_multiplier": 1,
        "max_mem_ratio": 0.7,
        "cpu_weight": 0.1,
        "connection_weight": 1,
        "size_match_weight": 1e-2,
        "complexity_match_weight": 10,
        "entropy_weight": 1,
        "iterations": 500,
        "update_rate": 0.01,
        "gpu_gpu_distance": 1,
        "cpu_gpu_distance": 10,
        "move_models": False,
        "device_memory": [1000 * KIB, 1000 * KIB, 1000 * KIB],
    }
