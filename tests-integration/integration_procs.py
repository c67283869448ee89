"""Run a command in a process group of its own, and end the whole group whatever happens (test-only).

torchrun's agent, its workers and anything a docs example starts share the group, so nothing a test starts
outlives it: not on success, not on a timeout, not when pytest-timeout interrupts the test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["run_group"]


def run_group(
    command: Sequence[str], *, cwd: Path, env: Mapping[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` to its end (text output captured), then SIGKILL whatever is left in its group.

    Raises:
        subprocess.TimeoutExpired: the command ran longer than ``timeout`` seconds (its group is killed
            first; the exception carries the output so far).
    """
    with subprocess.Popen(
        list(command),
        cwd=cwd,
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate(timeout=30)
            raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
