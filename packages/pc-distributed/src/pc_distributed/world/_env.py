"""Resolution of a World's rank, size and address: argument, then torchrun's environment, then loopback.

Pure functions returning plain data, so the rules can be tested without starting anything.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from pc_distributed._checks import integer

__all__ = ["WorldSpec", "check_name", "is_loopback", "resolve_world_spec", "uses_agent_store"]

_NAME_RE = re.compile(r"^[A-Za-z0-9_:\-]{1,127}$")


@dataclass(frozen=True)
class WorldSpec:
    """Where and how a World meets its peers.

    Attributes:
        rank: This process's rank.
        world_size: Number of processes.
        dist_url: ``tcp://`` or user init method for the store and the process group.
        rpc_url: Init method for RPC (the same store by default; TCPStore is multi-tenant).
        agent_store: True when an outside agent (torchrun, ``run_world``) serves the store, so every rank is a
            client.
        host: The rendezvous host when we built ``dist_url`` (None for a user-given init method).
        port: The rendezvous port when we built ``dist_url`` (0: a free port).
    """

    rank: int
    world_size: int
    dist_url: str
    rpc_url: str
    agent_store: bool
    host: str | None = None
    port: int | None = None

    def serves_store(self) -> bool:
        """True when this rank serves the store itself on ``host`` (rank 0, no agent, an address we built)."""
        return self.rank == 0 and not self.agent_store and self.host is not None

    def serves_loopback(self) -> bool:
        """True when this rank serves the store itself on a loopback address."""
        return self.serves_store() and self.host is not None and is_loopback(self.host)

    def on_loopback(self) -> bool:
        """True when the world meets on a loopback address (so it is a one-host world)."""
        return self.host is not None and is_loopback(self.host)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names the loopback interface (``127.x.y.z``, ``::1`` or ``localhost``)."""
    return host == "localhost" or host == "::1" or host.startswith("127.")


def check_name(name: object) -> str:
    """Validate a member name (RPC's rule: letters, digits, ``_``, ``:``, ``-``; 1 to 127 characters).

    Raises:
        TypeError: If ``name`` is not a ``str``.
        ValueError: If it breaks the rule.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__} {name!r}")
    if not _NAME_RE.match(name):
        raise ValueError(f"name must match [A-Za-z0-9_:-]{{1,127}}, got {name!r}")
    return name


def uses_agent_store(env: Mapping[str, str]) -> bool:
    """True when torchrun (or ``run_world``) already serves the store at ``MASTER_ADDR:MASTER_PORT``."""
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _env_int(env: Mapping[str, str], key: str) -> int | None:
    raw = env.get(key)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {key} must be an integer, got {raw!r}") from None


def resolve_world_spec(
    rank: int,
    world_size: int,
    dist_init_method: str | None,
    rpc_init_method: str | None,
    env: Mapping[str, str] | None = None,
    addr: str | None = None,
) -> WorldSpec:
    """Resolve rank, size and init methods: argument, then the torchrun environment, then loopback.

    Args:
        rank: Rank argument (-1: from ``RANK``, else 0).
        world_size: Size argument (-1: from ``WORLD_SIZE``, else 1).
        dist_init_method: Explicit init method for the store and process group, or None.
        rpc_init_method: Explicit init method for RPC, or None (then the same store as ``dist_init_method``).
        env: Environment to read (default ``os.environ``).
        addr: The rendezvous address (host name or IP), before ``MASTER_ADDR``; not with ``dist_init_method``.

    Returns:
        The resolved :class:`WorldSpec`.

    Raises:
        TypeError: If rank or world_size is not an int.
        ValueError: If they are out of range, a multi-process world has no address to meet at, or both
            ``addr`` and ``dist_init_method`` are given.
    """
    env = os.environ if env is None else env
    for label, value in (("rank", rank), ("world_size", world_size)):
        integer(label, value)
    if rank < 0:
        env_rank = _env_int(env, "RANK")
        rank = 0 if env_rank is None else env_rank
    if world_size < 0:
        env_size = _env_int(env, "WORLD_SIZE")
        world_size = 1 if env_size is None else env_size
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    host: str | None = None
    port: int | None = None
    if addr is not None and (not isinstance(addr, str) or not addr):
        raise TypeError(f"addr must be a non-empty str (a host name or an IP address), got {addr!r}")
    if addr is not None and dist_init_method is not None:
        raise ValueError(f"pass addr ({addr!r}) or dist_init_method ({dist_init_method!r}), not both")
    if dist_init_method is not None:
        if not isinstance(dist_init_method, str):
            raise TypeError(f"dist_init_method must be a str or None, got {type(dist_init_method).__name__}")
        dist_url = dist_init_method
    else:
        host = addr or env.get("MASTER_ADDR") or "127.0.0.1"
        port = _env_int(env, "MASTER_PORT")
        if port is None:
            if world_size > 1:
                raise ValueError(
                    f"a world of {world_size} processes needs a rendezvous address: set MASTER_ADDR/"
                    "MASTER_PORT, pass dist_init_method, or start it with pc_distributed.run_world "
                    "(which picks free ports)"
                )
            port = 0  # a one-process world binds a free port
        if not 0 <= port < 2**16:
            raise ValueError(f"MASTER_PORT must be in [0, 65535], got {port}")
        dist_url = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
    if rpc_init_method is not None and not isinstance(rpc_init_method, str):
        raise TypeError(f"rpc_init_method must be a str or None, got {type(rpc_init_method).__name__}")
    return WorldSpec(
        rank=rank,
        world_size=world_size,
        dist_url=dist_url,
        rpc_url=rpc_init_method if rpc_init_method is not None else dist_url,
        agent_store=uses_agent_store(env),
        host=host,
        port=port,
    )
