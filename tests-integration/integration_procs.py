"""Run a command in a process group of its own, and end the whole group whatever happens (test-only).

torchrun's agent, its workers and anything a docs example starts share the group (or descend from the
command, where they start sessions of their own), so nothing a test starts outlives it: not on success, not
on a timeout, not when pytest-timeout interrupts the test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

__all__ = ["run_group"]


def run_group(
    command: Sequence[str], *, cwd: Path, env: Mapping[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` to its end (text output captured), then SIGKILL whatever is left in its group.

    At a timeout its descendants are killed too, also those in sessions of their own (torchrun starts its
    workers in new sessions on some releases), so none outlives the test or holds the output pipes open.

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
            _kill_tree(proc.pid)
            out, err = proc.communicate(timeout=30)
            raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
        finally:
            if proc.returncode is None:  # interrupted (pytest-timeout): the whole tree is still there
                _kill_tree(proc.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _kill_tree(pid: int) -> None:
    """SIGKILL process ``pid``'s group and every descendant of ``pid`` (found before any is killed)."""
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for child in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
