"""Test configuration shared by every package's tests and the integration tests.

`gpu`-marked tests are skipped when no CUDA device is visible; with
``PC_REQUIRE_GPU=1`` (set by ``nox -s gpu``) a missing device is an error instead,
so a GPU runner that lost its GPU cannot pass by skipping everything.
"""

from __future__ import annotations

import os

import pytest


def _cuda_device_count() -> int:
    try:
        import torch
    except ImportError:  # pragma: no cover - every package depends on torch
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip (or, under PC_REQUIRE_GPU=1, fail) `gpu` tests when CUDA is missing."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items or _cuda_device_count() > 0:
        return
    if os.environ.get("PC_REQUIRE_GPU") == "1":
        raise pytest.UsageError("PC_REQUIRE_GPU=1 but no CUDA device is visible to torch")
    skip = pytest.mark.skip(reason="needs a CUDA device (run with nox -s gpu on a GPU machine)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def cuda_devices() -> int:
    """Number of visible CUDA devices; use with `@pytest.mark.gpu` tests that need several."""
    return _cuda_device_count()
