"""Packaging checks for pc-sync: version and public names."""

import importlib.metadata
import subprocess
import sys

import pc_sync


def test_version_matches_installed_metadata() -> None:
    assert pc_sync.__version__ == importlib.metadata.version("pc-sync")


def test_all_names_exist_and_are_documented() -> None:
    for name in pc_sync.__all__:
        obj = getattr(pc_sync, name)
        if not isinstance(obj, str):
            assert obj.__doc__, f"{name} has no docstring"


def test_process_group_batch_norm_is_public() -> None:
    assert {"SyncBatchNorm", "convert_sync_batchnorm"} <= set(pc_sync.__all__)


def test_runtime_imports_torch_only() -> None:
    # pc-distributed is a test-only dependency: using pc_sync must not load it (nor pc_replicate).
    code = (
        "import sys, torch, pc_sync\n"
        "pc_sync.SyncBatchNorm(3)(torch.randn(4, 3))\n"
        "pc_sync.convert_sync_batchnorm(torch.nn.BatchNorm1d(3))\n"
        "print(sorted(m for m in sys.modules if m.startswith(('pc_distributed', 'pc_replicate'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
