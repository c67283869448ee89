"""Test configuration shared by every package's tests and the integration tests.

`gpu`-marked tests are skipped when no CUDA device is visible; with
``PC_REQUIRE_GPU=1`` (set by ``nox -s gpu``) a missing device is an error instead,
so a GPU runner that lost its GPU cannot pass by skipping everything.

The property-based (`adversarial`) suites share one hypothesis profile, ``pc``: ``PC_ADVERSARIAL_EXAMPLES``
examples per property (a few in ``nox -s tests``; ``nox -s adversarial`` raises it), no deadline (the
machines are shared), derandomized so that CI runs the same examples every time, unless
``PC_ADVERSARIAL_SEED=N`` asks for others (hypothesis's ``--hypothesis-seed``). A failure prints the
falsifying example and its reproduction blob.
"""

from __future__ import annotations

import os

import pytest

ADVERSARIAL_EXAMPLES = int(os.environ.get("PC_ADVERSARIAL_EXAMPLES", "20"))
_ADVERSARIAL_SEED = os.environ.get("PC_ADVERSARIAL_SEED")

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # a package's own venv without the test extras: no property-based tests run there
    pass
else:
    settings.register_profile(
        "pc",
        max_examples=ADVERSARIAL_EXAMPLES,
        deadline=None,
        derandomize=_ADVERSARIAL_SEED is None,
        print_blob=True,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,
        ],
    )
    settings.load_profile("pc")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Hand ``PC_ADVERSARIAL_SEED`` to hypothesis's pytest plugin (it reads the option when it configures)."""
    seedless = getattr(config.option, "hypothesis_seed", "") is None
    if _ADVERSARIAL_SEED is not None and seedless:
        config.option.hypothesis_seed = _ADVERSARIAL_SEED


def pytest_report_header(config: pytest.Config) -> str:
    """Say which adversarial examples run: the line to repeat a failure with."""
    how = f"seed {_ADVERSARIAL_SEED}" if _ADVERSARIAL_SEED is not None else "derandomized"
    return f"pc adversarial: {ADVERSARIAL_EXAMPLES} examples per property, {how} (PC_ADVERSARIAL_SEED=N)"


def _cuda_device_count() -> int:
    try:
        import torch
    except ImportError:  # pragma: no cover - every package depends on torch
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `backends_inside` tests in a session that picks the RPC backend; skip (or fail) `gpu` ones."""
    if os.environ.get("PC_RPC_BACKEND"):
        again = pytest.mark.skip(reason="picks its RPC backends itself (or none): the default run has it")
        for item in items:
            if "backends_inside" in item.keywords:
                item.add_marker(again)
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
