"""The test harness's process runner: a command that times out leaves no process behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from integration_procs import run_group

# A parent that starts a child in a session of its own (as torchrun does with its workers on some releases),
# prints the child's pid, then hangs; both sleeps stand for hung work, not for synchronisation.
_HANGS = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_timeout_kills_descendants_in_sessions_of_their_own(tmp_path: Path) -> None:
    with pytest.raises(subprocess.TimeoutExpired) as info:
        run_group([sys.executable, "-c", _HANGS], cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}, timeout=5)
    out = info.value.output
    pid = int(out.split()[0]) if out else -1
    assert pid > 0, f"the parent printed no child pid: {out!r}"
    psutil.wait_procs([p for p in [_proc(pid)] if p is not None], timeout=10)
    assert _gone(pid), f"the child {pid} in its own session outlived the timeout"


def _proc(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None
