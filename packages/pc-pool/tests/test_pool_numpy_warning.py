"""Without numpy, torch warns "Failed to initialize NumPy" on import; pc-pool and its workers add no more."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pc_pool import _quiet

# Every process started with this directory on PYTHONPATH (spawned workers included) cannot import numpy.
_BLOCK_NUMPY = """
import sys


class _NoNumpy:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ModuleNotFoundError("No module named 'numpy'", name="numpy")
        return None


sys.meta_path.insert(0, _NoNumpy)
"""

_SCRIPT = """
{first_import}
from pc_pool import Pool
from pc_pool._quiet import numpy_missing

if __name__ == "__main__":
    print("numpy missing:", numpy_missing())
    with Pool(2) as pool:  # spawn: each worker is a fresh interpreter that imports torch
        print(pool.map(lambda x: x * 2, range(4)))
"""


def _run_without_numpy(tmp_path: Path, first_import: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "sitecustomize.py").write_text(_BLOCK_NUMPY)
    script = tmp_path / "script.py"
    script.write_text(_SCRIPT.format(first_import=first_import))
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["numpy missing: True", "[0, 2, 4, 6]"], proc.stdout
    return proc


@pytest.mark.slow
def test_pool_program_without_numpy_prints_no_numpy_warning(tmp_path: Path) -> None:
    proc = _run_without_numpy(tmp_path, first_import="")
    assert _quiet.NUMPY_WARNING not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_pool_workers_do_not_repeat_the_warning_of_the_callers_torch_import(tmp_path: Path) -> None:
    # The caller's own `import torch` warns once, as torch does in any program; the two workers stay quiet.
    proc = _run_without_numpy(tmp_path, first_import="import torch")
    assert proc.stderr.count(_quiet.NUMPY_WARNING) == 1, proc.stderr


def test_pool_numpy_warning_option_is_set_only_while_starting_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_quiet, "numpy_missing", lambda: True)
    monkeypatch.setattr(sys, "warnoptions", ["default"])
    with _quiet.quiet_numpy_warning_in_children():
        assert sys.warnoptions == ["default", _quiet.NUMPY_WARNING_OPTION]
        with _quiet.quiet_numpy_warning_in_children():  # nested (another pool starting a worker)
            assert sys.warnoptions.count(_quiet.NUMPY_WARNING_OPTION) == 1
        assert _quiet.NUMPY_WARNING_OPTION in sys.warnoptions
    assert sys.warnoptions == ["default"]
    # An option the user gave (python -W ...) stays.
    monkeypatch.setattr(sys, "warnoptions", [_quiet.NUMPY_WARNING_OPTION])
    with _quiet.quiet_numpy_warning_in_children():
        pass
    assert sys.warnoptions == [_quiet.NUMPY_WARNING_OPTION]


def test_pool_numpy_warning_option_untouched_when_numpy_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_quiet, "numpy_missing", lambda: False)
    monkeypatch.setattr(sys, "warnoptions", [])
    with _quiet.quiet_numpy_warning_in_children():
        assert sys.warnoptions == []
