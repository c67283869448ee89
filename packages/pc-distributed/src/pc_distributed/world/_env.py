"""Resolution of a World's rank, size and address: argument, then torchrun's environment, then loopback.

Pure functions returning plain data, so the rules can be tested without starting anything.

An init method is a URL of one of torch's three rendezvous schemes, parsed here so that pc knows who serves
the store: ``tcp://host:port`` (IPv6 hosts in brackets) and ``env://`` (``MASTER_ADDR``/``MASTER_PORT``) name
a TCPStore that rank 0 serves on exactly that host, unless an agent (torchrun, ``run_world``) serves it;
``file:///path`` names a file every rank opens (no server). As with torch, a URL's query may carry ``rank``
and ``world_size`` (used when the arguments are -1) and ``use_libuv`` (accepted; pc picks the store's server
itself).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlparse

from pc_distributed._checks import integer

__all__ = [
    "InitMethod",
    "WorldSpec",
    "check_name",
    "is_loopback",
    "parse_init_method",
    "resolve_world_spec",
    "uses_agent_store",
]

_NAME_RE = re.compile(r"^[A-Za-z0-9_:\-]{1,127}$")
_FORMS = "'tcp://host:port', 'env://' (MASTER_ADDR/MASTER_PORT) or 'file:///path'"
# The query keys torch's handlers read, per scheme (``use_libuv`` picks the server, which pc picks itself).
_QUERY_KEYS: dict[str, tuple[str, ...]] = {
    "tcp": ("rank", "world_size", "use_libuv"),
    "env": ("rank", "world_size", "use_libuv"),
    "file": ("rank", "world_size"),
}


@dataclass(frozen=True)
class WorldSpec:
    """Where and how a World meets its peers.

    Attributes:
        rank: This process's rank.
        world_size: Number of processes.
        dist_url: The store's and process group's init method: ``tcp://host:port`` (also for ``env://`` and
            for MASTER_ADDR/MASTER_PORT), or a ``file://`` URL; without a query.
        rpc_url: Init method for TensorPipe's RPC (the same store by default; TCPStore is multi-tenant).
        agent_store: True when an outside agent (torchrun, ``run_world``) serves the store, so every rank is a
            client.
        host: The store's host (None for a ``file://`` store, which has no server).
        port: The store's port (0: a free port, in a one-process world).
        rpc_host: The host of a TCPStore of RPC's own, apart from the World's store (an ``rpc_init_method``
            naming another address), which rank 0 serves whether or not an agent serves the World's; or None.
        rpc_port: That store's port, else None.
    """

    rank: int
    world_size: int
    dist_url: str
    rpc_url: str
    agent_store: bool
    host: str | None = None
    port: int | None = None
    rpc_host: str | None = None
    rpc_port: int | None = None

    def serves_store(self) -> bool:
        """True when this rank serves the store itself on ``host`` (rank 0, no agent, a TCP address)."""
        return self.rank == 0 and not self.agent_store and self.host is not None

    def serves_loopback(self) -> bool:
        """True when this rank serves the store itself on a loopback address."""
        return self.serves_store() and self.host is not None and is_loopback(self.host)

    def on_loopback(self) -> bool:
        """True when the world meets on a loopback address (so it is a one-host world)."""
        return self.host is not None and is_loopback(self.host)


@dataclass(frozen=True)
class InitMethod:
    """An init-method URL, parsed.

    Attributes:
        url: The URL without its query: ``tcp://host:port`` for ``tcp://`` and ``env://``, else as given.
        host: The TCPStore's host (``tcp://``, ``env://``), None for ``file://``.
        port: The TCPStore's port, None for ``file://``.
        rank: The query's ``rank``, if any.
        world_size: The query's ``world_size``, if any.
    """

    url: str
    host: str | None
    port: int | None
    rank: int | None = None
    world_size: int | None = None


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


def _check_port(label: str, port: int) -> int:
    if not 0 <= port < 2**16:
        raise ValueError(f"{label} must be in [0, 65535], got {port}")
    return port


def _tcp_url(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _query_int(label: str, url: str, key: str, query: Mapping[str, str]) -> int | None:
    raw = query.get(key)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{label} {url!r}: {key} must be an integer, got {raw!r}") from None


def parse_init_method(label: str, url: object, env: Mapping[str, str]) -> InitMethod:
    """Parse an init-method URL (``dist_init_method`` or ``rpc_init_method``); ``env://`` reads ``env``.

    Args:
        label: The argument's name, for messages.
        url: The URL.
        env: The environment ``env://`` reads (``MASTER_ADDR``, ``MASTER_PORT``).

    Raises:
        TypeError: If ``url`` is not a str.
        ValueError: If it is not one of torch's forms (``tcp://host:port``, ``env://``, ``file:///path``),
            lacks a host, a port or a path, names a port out of range, or has a query key other than
            ``rank``, ``world_size`` or ``use_libuv`` (``tcp://``, ``env://``).
    """
    if not isinstance(url, str):
        raise TypeError(f"{label} must be a str or None, got {type(url).__name__}")
    parsed = urlparse(url)
    if "://" not in url or parsed.scheme not in _QUERY_KEYS:
        raise ValueError(f"{label} must be {_FORMS}, got {url!r}")
    scheme = parsed.scheme
    query = dict(parse_qsl(parsed.query, keep_blank_values=True))
    unknown = sorted(set(query) - set(_QUERY_KEYS[scheme]))
    if unknown:
        raise ValueError(
            f"{label} {url!r}: unknown query key(s) {unknown}; a {scheme}:// URL takes "
            f"{list(_QUERY_KEYS[scheme])}"
        )
    rank = _query_int(label, url, "rank", query)
    world_size = _query_int(label, url, "world_size", query)
    if scheme == "file":
        if parsed.netloc not in ("", "localhost") or not parsed.path or parsed.path == "/":
            raise ValueError(
                f"{label} {url!r}: a file:// URL names an absolute path, as in 'file:///tmp/rdzv'"
            )
        return InitMethod(f"file://{parsed.path}", None, None, rank, world_size)
    if scheme == "env":
        if parsed.netloc or parsed.path:
            raise ValueError(
                f"{label} {url!r}: an env:// URL names no address (it reads MASTER_ADDR/MASTER_PORT)"
            )
        host = env.get("MASTER_ADDR", "")
        port = _env_int(env, "MASTER_PORT")
        if not host or port is None:
            missing = [
                key for key, value in (("MASTER_ADDR", host), ("MASTER_PORT", port)) if value in ("", None)
            ]
            raise ValueError(f"{label} {url!r} reads MASTER_ADDR and MASTER_PORT, but {missing} not set")
        return InitMethod(_tcp_url(host, port), host, _check_port("MASTER_PORT", port), rank, world_size)
    try:
        tcp_port = parsed.port
    except ValueError as exc:  # not a number, or out of range
        raise ValueError(f"{label} {url!r}: the port must be an integer in [0, 65535] ({exc})") from None
    if not parsed.hostname or tcp_port is None:
        raise ValueError(
            f"{label} {url!r}: a tcp:// URL names a host and a port, as in 'tcp://127.0.0.1:29500'"
        )
    if parsed.path not in ("", "/"):
        raise ValueError(f"{label} {url!r}: a tcp:// URL has no path, as in 'tcp://127.0.0.1:29500'")
    return InitMethod(_tcp_url(parsed.hostname, tcp_port), parsed.hostname, tcp_port, rank, world_size)


def _same_store(one: InitMethod, other: InitMethod) -> bool:
    if one.host is None or other.host is None:
        return one.url == other.url
    return (one.host.lower(), one.port) == (other.host.lower(), other.port)


def _pick(label: str, arg: int, given: list[tuple[str, int | None]], env: Mapping[str, str], key: str) -> int:
    """The argument if >= 0 (every URL query naming one must agree), else a URL query's, else ``env[key]``.

    Returns -1 where none says.
    """
    said = [(where, value) for where, value in given if value is not None]
    if arg >= 0:
        for where, value in said:
            if value != arg:
                raise ValueError(f"{label} is {arg}, but {where} says {label}={value}")
        return arg
    if said:
        if len({value for _, value in said}) > 1:
            raise ValueError(f"the init methods disagree on {label}: {dict(said)}")
        return said[0][1]
    from_env = _env_int(env, key)
    return -1 if from_env is None else from_env


def resolve_world_spec(
    rank: int,
    world_size: int,
    dist_init_method: str | None,
    rpc_init_method: str | None,
    env: Mapping[str, str] | None = None,
    addr: str | None = None,
) -> WorldSpec:
    """Resolve rank, size and init methods: argument, then the URLs' queries, then torchrun's environment.

    Without ``dist_init_method`` the store is at ``addr`` (else ``MASTER_ADDR``, else ``127.0.0.1``) and
    ``MASTER_PORT`` (a free port in a one-process world). A ``tcp://`` or ``env://`` ``dist_init_method``
    names the store's address the same way; rank 0 serves it unless an agent does. An ``rpc_init_method``
    naming the World's own address (or none) means RPC shares the World's store; another ``tcp://`` or
    ``env://`` address is a store of RPC's own, which rank 0 serves.

    Args:
        rank: Rank argument (-1: from a URL's query, else ``RANK``, else 0).
        world_size: Size argument (-1: from a URL's query, else ``WORLD_SIZE``, else 1).
        dist_init_method: Explicit init method for the store and process group, or None.
        rpc_init_method: Explicit init method for RPC, or None (then the same store as ``dist_init_method``).
        env: Environment to read (default ``os.environ``).
        addr: The rendezvous address (host name or IP), before ``MASTER_ADDR``; not with ``dist_init_method``.

    Returns:
        The resolved :class:`WorldSpec`.

    Raises:
        TypeError: If rank or world_size is not an int, or an init method not a str.
        ValueError: If they are out of range or disagree with a URL's query, a multi-process world has no
            address to meet at (or port 0), both ``addr`` and ``dist_init_method`` are given, or an init
            method is malformed (see :func:`parse_init_method`).
    """
    env = os.environ if env is None else env
    for label, value in (("rank", rank), ("world_size", world_size)):
        integer(label, value)
    if addr is not None and (not isinstance(addr, str) or not addr):
        raise TypeError(f"addr must be a non-empty str (a host name or an IP address), got {addr!r}")
    if addr is not None and dist_init_method is not None:
        raise ValueError(f"pass addr ({addr!r}) or dist_init_method ({dist_init_method!r}), not both")
    dist = None if dist_init_method is None else parse_init_method("dist_init_method", dist_init_method, env)
    rpc = None if rpc_init_method is None else parse_init_method("rpc_init_method", rpc_init_method, env)
    queries = [
        (f"{label} {m.url!r}", m) for label, m in (("dist_init_method", dist), ("rpc_init_method", rpc)) if m
    ]
    rank = _pick("rank", rank, [(where, m.rank) for where, m in queries], env, "RANK")
    world_size = _pick(
        "world_size", world_size, [(where, m.world_size) for where, m in queries], env, "WORLD_SIZE"
    )
    rank = 0 if rank < 0 else rank
    world_size = 1 if world_size < 0 else world_size
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if dist is None:
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
        dist = InitMethod(_tcp_url(host, _check_port("MASTER_PORT", port)), host, port)
    for label, method in (("dist_init_method", dist), ("rpc_init_method", rpc)):
        if method is not None and method.port == 0 and world_size > 1:
            raise ValueError(
                f"{label} {method.url!r}: a world of {world_size} processes cannot meet at port 0 (each "
                "would bind a free port of its own); name a port, or start it with pc_distributed.run_world"
            )
    rpc_host = rpc_port = None
    if rpc is None or _same_store(rpc, dist):
        rpc_url = dist.url  # RPC shares the World's store
    else:
        rpc_url, rpc_host, rpc_port = rpc.url, rpc.host, rpc.port
    return WorldSpec(
        rank=rank,
        world_size=world_size,
        dist_url=dist.url,
        rpc_url=rpc_url,
        agent_store=uses_agent_store(env),
        host=dist.host,
        port=dist.port,
        rpc_host=rpc_host,
        rpc_port=rpc_port,
    )
