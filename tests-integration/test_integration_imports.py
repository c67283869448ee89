"""Every module of every package imports with warnings as errors, in one fresh interpreter.

A deprecation that a new torch release adds to an API we use then fails here on the day that release enters
the support matrix (``nox -s compat``), not on the day torch removes the API.
"""

from __future__ import annotations

import subprocess
import sys

PACKAGES = ["pc_pickle", "pc_pool", "pc_replicate", "pc_sync", "pc_distributed", "pc_server", "pc_assigner"]

_IMPORT_ALL = """
import importlib, pkgutil, sys
for top in sys.argv[1:]:
    package = importlib.import_module(top)
    names = [m.name for m in pkgutil.walk_packages(package.__path__, top + ".")]
    for name in names:
        importlib.import_module(name)
    print(top, len(names))
"""


def test_every_module_imports_without_a_warning() -> None:
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", _IMPORT_ALL, *PACKAGES],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"an import warned or failed:\n{done.stderr[-3000:]}"
    counts = dict(line.split() for line in done.stdout.splitlines())
    assert sorted(counts) == sorted(PACKAGES)
    assert all(int(n) > 1 for n in counts.values()), counts  # each package's modules were walked
