"""The RPC backends by name: which one a World uses, and starting it (the World's one entry to them).

Both :func:`~pc_distributed.run_world` (once, for every rank) and :class:`~pc_distributed.World` resolve the
``rpc_backend`` argument with :func:`choose_backend`, and the World starts the chosen one with
:func:`start_backend`, handing it one :class:`~._backend.BackendSetup`. A backend is a class of its own
module (a :class:`~._backend.BackendType`); :data:`BACKENDS` lists them, so a new backend is its module plus
one line here (CONTRIBUTING.md, "Adding an RPC backend").
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType

from pc_distributed.rpc._backend import BackendSetup, BackendType, RpcBackend
from pc_distributed.rpc._c10d import C10dBackend
from pc_distributed.rpc._tensorpipe import TensorPipeBackend

__all__ = [
    "AUTO_CHOICE",
    "BACKENDS",
    "ENV_VAR",
    "FALLBACK_CHOICE",
    "BackendSetup",
    "RpcBackend",
    "choose_backend",
    "start_backend",
]

BACKENDS: Mapping[str, BackendType] = MappingProxyType(
    {
        "tensorpipe": TensorPipeBackend,
        "c10d": C10dBackend,
    }
)
"""The backends by the name ``rpc_backend`` selects them by."""
ENV_VAR = "PC_RPC_BACKEND"
"""The environment variable that ``rpc_backend="auto"`` reads first (a name of :data:`BACKENDS`)."""
AUTO_CHOICE = "tensorpipe"
"""What ``auto`` picks when this torch has it and the variable is unset (docs/distributed.md says why)."""
FALLBACK_CHOICE = "c10d"
"""What ``auto`` picks when this torch lacks :data:`AUTO_CHOICE` (it needs only gloo)."""


def choose_backend(requested: object) -> str:
    """The name of the backend a World uses for ``rpc_backend=requested``.

    A name of :data:`BACKENDS` (any case) is taken as given, where this torch build has that backend.
    ``"auto"`` is :data:`ENV_VAR` if set, else :data:`AUTO_CHOICE` where this torch has it, else
    :data:`FALLBACK_CHOICE`.

    Raises:
        TypeError: If ``requested`` is not a str.
        ValueError: If it (or the variable) names no backend (the message lists the names), or names one
            that this torch build lacks.
    """
    if not isinstance(requested, str):
        raise TypeError(f"rpc_backend must be a str, got {type(requested).__name__}")
    choice, source = requested.lower(), f"rpc_backend {requested!r}"
    if choice == "auto":
        from_env = os.environ.get(ENV_VAR, "").strip().lower()
        if from_env:
            choice, source = from_env, f"{ENV_VAR}={os.environ[ENV_VAR]!r}"
        else:
            choice = AUTO_CHOICE if BACKENDS[AUTO_CHOICE].missing() is None else FALLBACK_CHOICE
    backend = BACKENDS.get(choice)
    if backend is None:
        raise ValueError(f"{source}: expected one of {[*BACKENDS, 'auto']}")
    why = backend.missing()
    if why is not None:
        usable = [repr(name) for name, other in BACKENDS.items() if other.missing() is None]
        raise ValueError(f"{source}: {why}; use {' or '.join([*usable, repr('auto')])}")
    return choice


def start_backend(name: str, setup: BackendSetup) -> RpcBackend:
    """Start the backend ``name`` (as :func:`choose_backend` returned it) for this member.

    Raises:
        ValueError: If ``name`` is not a name of :data:`BACKENDS`.
        TimeoutError: If the start-up does not finish within ``setup.start_timeout`` (plus a grace).
    """
    backend = BACKENDS.get(name)
    if backend is None:
        raise ValueError(f"no RPC backend named {name!r}; expected one of {list(BACKENDS)}")
    return backend.start(setup)
