"""Test helpers for the release test: a real package index (pypiserver) on loopback and fresh venvs.

The index listens on 127.0.0.1 only, on a free port that the OS picks for a probe socket just before the start
(the only way pypiserver takes a port); it is ready when its simple API answers, polled for a bounded time.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

START_TIMEOUT_S = 60.0
INSTALL_TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the process that started it dies (Linux prctl)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0):
            return True
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def package_index(packages_dir: Path) -> Iterator[str]:
    """Run pypiserver over ``packages_dir`` (uploads allowed, no auth); yield its base URL; stop it after."""
    port = _free_port()
    cmd = [sys.executable, "-m", "pypiserver", "run", "-i", "127.0.0.1", "-p", str(port)]
    cmd += ["-a", ".", "-P", ".", "--disable-fallback", str(packages_dir)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_die_with_parent,  # also when pytest-timeout ends the test process without cleanup
    )
    base = f"http://127.0.0.1:{port}/"
    try:
        ready = _wait_until(lambda: proc.poll() is not None or _answers(base + "simple/"), START_TIMEOUT_S)
        if proc.poll() is not None or not ready:
            err = proc.stderr.read().decode() if proc.poll() is not None and proc.stderr else ""
            raise RuntimeError(f"pypiserver did not start on {base} within {START_TIMEOUT_S} s: {err}")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        if proc.stderr:
            proc.stderr.close()


def _wait_until(done: Callable[[], bool], timeout: float) -> bool:
    """Call ``done()`` every 50 ms until it is true (True) or ``timeout`` passed (False)."""
    deadline = time.monotonic() + timeout
    tick = threading.Event()
    while True:
        if done():
            return True
        if time.monotonic() >= deadline:
            return False
        tick.wait(0.05)


class Venv:
    """A fresh virtual environment made with uv (``PC_UV``) when available, else with venv + pip."""

    def __init__(self, path: Path, constraints: Path) -> None:
        self.path = path
        self.constraints = constraints
        self.uv = os.environ.get("PC_UV") or shutil.which("uv")
        if self.uv:
            self._run([self.uv, "venv", "-q", "--python", sys.executable, str(path)])
        else:
            self._run([sys.executable, "-m", "venv", str(path)])
        self.python = str(path / "bin" / "python")

    @staticmethod
    def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def install(self, index_url: str, *requirements: str, upgrade: bool = False) -> None:
        """Install from ``index_url`` first (pc packages live only there), third parties as configured."""
        up = ["--upgrade"] if upgrade else []
        if self.uv:
            # uv's default "first-index" strategy: a name found on our index is taken only from there
            cmd = [self.uv, "pip", "install", "-q", "--python", self.python, "--index", index_url]
        else:
            cmd = [self.python, "-m", "pip", "install", "-q", "--extra-index-url", index_url]
            up += ["--upgrade-strategy", "eager"] if upgrade else []  # as uv's --upgrade: dependencies too
        self._run([*cmd, *up, "-c", str(self.constraints), *requirements])

    def distributions(self) -> dict[str, str]:
        """``{name: version}`` of the pc-* distributions installed in this venv."""
        code = (
            "import importlib.metadata as m, json; "
            "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions() "
            "if d.metadata['Name'].startswith('pc-')}))"
        )
        return dict(json.loads(self._run([self.python, "-c", code]).stdout))

    def run(self, code: str) -> str:
        """Run ``code`` with this venv's Python; return its stdout."""
        return self._run([self.python, "-c", code]).stdout
