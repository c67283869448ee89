"""Exceptions raised by pc_pool.

Every error subclasses the closest standard exception, so existing ``except`` clauses keep working:

* :class:`WorkerDiedError` is a :class:`RuntimeError`: the worker process that held a task died.
* :class:`PoolTerminatedError` is a :class:`concurrent.futures.CancelledError`: ``terminate()`` came first.
* :class:`RemoteTraceback` carries the formatted traceback of an exception raised in a worker; it is set as
  the ``__cause__`` of the re-raised exception, as :mod:`concurrent.futures` does.
"""

from __future__ import annotations

import concurrent.futures
import signal

__all__ = ["PoolTerminatedError", "RemoteTraceback", "WorkerDiedError"]


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class WorkerDiedError(RuntimeError):
    """The worker process died while it held the task.

    Attributes:
        pid: The process id of the dead worker.
        exitcode: Its exit code (``None`` when it was killed by a signal).
        signal: The name of the signal that killed it (``"SIGKILL"``), or ``None``.
    """

    def __init__(self, pid: int | None, exitcode: int | None) -> None:
        self.pid = pid
        self.exitcode = exitcode if exitcode is None or exitcode >= 0 else None
        self.signal = _signal_name(-exitcode) if exitcode is not None and exitcode < 0 else None
        if self.signal is not None:
            how = f"was killed by {self.signal}"
            if self.signal == "SIGKILL":
                how += " (the OOM killer?)"
            elif self.signal in ("SIGSEGV", "SIGBUS", "SIGABRT", "SIGFPE", "SIGILL"):
                how += " (see the worker's stderr: faulthandler is on in workers)"
        else:
            how = f"exited with code {exitcode}"
        super().__init__(f"pool worker (pid {pid}) {how} while running this task")

    def __reduce__(self) -> tuple[object, ...]:
        exitcode = self.exitcode
        if self.signal is not None:
            exitcode = (
                -int(signal.Signals[self.signal]) if self.signal in signal.Signals.__members__ else None
            )
        return (type(self), (self.pid, exitcode))


class PoolTerminatedError(concurrent.futures.CancelledError):
    """The pool was terminated before this result arrived."""


class RemoteTraceback(Exception):  # noqa: N818 - the name concurrent.futures and loky use
    """The traceback of an exception raised in a worker, as text.

    It is attached as ``__cause__`` to the exception re-raised in the caller, so the default traceback
    printout shows where in the worker the error happened.

    Attributes:
        tb: The formatted remote traceback.
    """

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'
