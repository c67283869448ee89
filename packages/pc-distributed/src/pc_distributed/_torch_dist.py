"""The thin layer over torch.distributed and torch.distributed.rpc for process groups, pair links and RPC.

Three kinds of torch calls live here, each used by a different part of the package: the World's default
process group and the collective groups' subgroups (:func:`check_backend`, :func:`init_pg`, :func:`new_group`,
:func:`destroy_pg`, :func:`p2p_carries`) and the elastic trainer's per-quorum groups (:func:`quorum_group` and
its collectives); the c10d RPC backend's links, a gloo process group per pair of members (:func:`pair_link`,
:func:`link_devices`); and TensorPipe's agent, which the TensorPipe backend (``rpc._tensorpipe``) starts and
stops through :func:`rpc_options`, :func:`init_rpc` and :func:`shutdown_rpc_agent`. :func:`bounded_here`
bounds torch's start-up calls that have no deadline against a silent store. The torch calls on stores
themselves are the store layer's (``pc_distributed._store._torch_store``).

Every torch call that sets up or tears down this global state lives here, so a change in torch touches one
file. Public torch APIs only, except TensorPipe's transports (:func:`rpc_options`) and gloo's group options
(:func:`link_devices`), each behind a capability check.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from pc_distributed._bounded import WAIT_GRACE, call_bounded
from pc_distributed._store import prefix_store

__all__ = [
    "abort_group",
    "bounded_here",
    "check_backend",
    "destroy_pg",
    "elastic_groups_available",
    "group_all_reduce_sum",
    "group_broadcast",
    "init_pg",
    "init_rpc",
    "link_devices",
    "nccl_quorum_group",
    "nccl_quorum_groups_available",
    "new_group",
    "p2p_carries",
    "pair_link",
    "quorum_group",
    "rpc_available",
    "rpc_options",
    "shutdown_rpc_agent",
]

_ProcessGroupGloo: Any = getattr(dist, "ProcessGroupGloo", None)
# NCCL's group (CUDA builds only). Its communicator config (``NCCLConfig``: ``blocking = 0`` makes the set-up
# return at once, so an abort can end a set-up a dead peer would block) is public on every supported release;
# the abort is ``abort()`` from torch 2.5 and ``_shutdown()`` before it (2.4's shutdown aborts; 2.5's is the
# graceful ``ncclCommDestroy``, which waits for the peers): see :func:`abort_group`.
_ProcessGroupNCCL: Any = getattr(dist, "ProcessGroupNCCL", None)
# gloo's group options: private (``_Options`` with ``_devices``, ``_timeout``, ``_threads``) on every release
# supported; where they are missing or named otherwise, each link makes its own device (link_devices: None).
_GLOO_OPTIONS: Any = getattr(_ProcessGroupGloo, "_Options", None)
_GLOO_OPTION_FIELDS = ("_devices", "_timeout", "_threads")
# TensorPipe's event-driven transport (libuv, TCP); its "shm" and "ibv" transports busy-poll.
_EVENT_TRANSPORT = "uv"

logger = logging.getLogger(__name__)


def p2p_carries(backend: str, device_type: str) -> bool:
    """Whether point-to-point ops of a group on ``backend`` take tensors on ``device_type`` as they are.

    Gloo's collectives stage CUDA tensors through the host, but its ``send``/``recv`` hand the tensor's memory
    to the socket: a CUDA tensor aborts the process (``gloo::IoException ... Bad address``). NCCL carries
    CUDA tensors; a group with one backend per device type reads ``"cpu:gloo,cuda:nccl"``. A backend not
    named here (MPI, a plug-in) is trusted with what torch hands it.

    Args:
        backend: What ``torch.distributed.get_backend(group)`` says.
        device_type: The tensor's ``device.type``.
    """
    if device_type == "cpu":
        return True
    name = backend.lower()
    if ":" in name:
        per_device = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
        name = per_device.get(device_type, "")
    return name != "gloo"


def rpc_available() -> bool:
    """Whether this torch build has ``torch.distributed.rpc`` (TensorPipe); builds may leave it out."""
    return bool(rpc.is_available())


def link_devices() -> list[Any] | None:
    """Gloo devices for all of a process's links (:func:`pair_link`), or None where torch cannot share them.

    A gloo device is an event-loop thread with its listening socket, and a ``ProcessGroupGloo`` made without
    options makes its own. Links that share them run one loop thread per process instead of one per peer:
    fewer threads to wake, and the events of several peers handled in one wait. The devices are the ones
    torch's constructor would make: one per interface named in ``GLOO_SOCKET_IFNAME`` (comma-separated), else
    the default device (the host name's address). Sharing needs gloo's group options, which are private (see
    ``_GLOO_OPTIONS``); without them this returns None and every link makes its own devices, as before.
    """
    if _ProcessGroupGloo is None or _GLOO_OPTIONS is None:
        return None
    if not all(hasattr(_GLOO_OPTIONS, field) for field in _GLOO_OPTION_FIELDS):
        return None
    named = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if len(named) > 1:  # torch's rule for the variable
        return [_ProcessGroupGloo.create_device(interface=name) for name in named.split(",") if name]
    return [_ProcessGroupGloo.create_default_device()]


def pair_link(store: Any, me: int, other: int, timeout: float, devices: list[Any] | None = None) -> Any:
    """A gloo process group of two members, ``me`` and ``other``, rendezvousing on ``store``.

    Both members call it (in the same order of pairs, so that no two wait on each other); the member with the
    lower number is the group's rank 0. The group is built with ``ProcessGroupGloo``'s constructor, not
    ``new_group``, so that it needs no default process group and is private to the pair: a timeout or a lost
    connection breaks this pair's group only (a shared device is only the loop that moves the bytes; the
    pairs, their timeouts and their failures stay per group).

    Args:
        store: The rendezvous store (scoped to the caller's World).
        me: This member's number.
        other: The peer's number.
        timeout: Seconds of the rendezvous and of every later wait on the group (gloo's context timeout).
        devices: Devices from :func:`link_devices` to share, or None (the group makes its own).

    Raises:
        RuntimeError: torch's error if the peer does not arrive within ``timeout`` or gloo is not built in.
    """
    if _ProcessGroupGloo is None:
        raise RuntimeError("this torch build has no gloo, which the c10d RPC backend's links need")
    low, high = sorted((me, other))
    scoped = prefix_store(f"link/{low}-{high}", store)
    rank = 0 if me == low else 1
    if devices is None:
        return _ProcessGroupGloo(scoped, rank, 2, timedelta(seconds=timeout))
    options = _GLOO_OPTIONS()
    options._devices = list(devices)
    options._timeout = timedelta(seconds=timeout)
    options._threads = 1  # the group's pool serves collectives, which links never run
    return _ProcessGroupGloo(scoped, rank, 2, options)


def bounded_here(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """:func:`call_bounded` with the caller's current CUDA device (a per-thread setting) on the helper thread.

    torch's own store requests in ``init_process_group``, ``new_group`` and RPC's start-up (gloo's and
    TensorPipe's rendezvous) have no deadline against a silent store; this bounds them. On a timeout the
    process's torch.distributed state may be half-made: stop the World (or the process).
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        device = torch.cuda.current_device()
        inner = fn

        def fn() -> Any:
            torch.cuda.set_device(device)
            return inner()

    return call_bounded(fn, timeout + WAIT_GRACE, what)


def check_backend(backend: str) -> str:
    """Check a process-group backend name before anything starts (torch itself only asserts, late).

    Accepts a backend torch knows and this build has (``"gloo"``, ``"nccl"`` on CUDA builds, ...), in any
    case, or ``"device:backend"`` pairs separated by commas (``"cpu:gloo,cuda:nccl"``).

    Raises:
        ValueError: Naming the backend and the ones this torch build has.
    """
    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    available = getattr(dist, "is_backend_available", lambda name: True)
    usable = [b for b in known if available(b)]
    for part in backend.split(","):
        name = part.split(":", 1)[-1].strip().lower()
        if name not in usable:
            why = (
                "is not available in this torch build"
                if name in known
                else "is not a torch.distributed backend"
            )
            raise ValueError(
                f"dist_backend {backend!r}: {name!r} {why}; this build has {usable} (or "
                "'device:backend' pairs such as 'cpu:gloo,cuda:nccl')"
            )
    return backend


def init_pg(store: Any, backend: str, rank: int, world_size: int, timeout: float) -> None:
    """Create the default process group on ``store``, within ``timeout`` (plus ``WAIT_GRACE``) seconds."""
    bounded_here(
        lambda: dist.init_process_group(
            backend=backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
        ),
        timeout,
        f"init_process_group (rank {rank} of {world_size}, backend {backend})",
    )


def new_group(ranks: list[int], timeout: float, backend: str | None) -> Any:
    """Torch's ``new_group`` (every rank of the world calls it), within ``timeout`` plus ``WAIT_GRACE`` s."""
    return bounded_here(
        lambda: dist.new_group(ranks, timeout=timedelta(seconds=timeout), backend=backend),
        timeout,
        f"new_group({ranks})",
    )


def destroy_pg() -> None:
    """Destroy the default process group (and every subgroup) if there is one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def rpc_options(url: str, timeout: float, busy_poll: bool) -> Any:
    """TensorPipe's options: ``url``, ``timeout`` and, unless ``busy_poll``, the event-driven transport only.

    TensorPipe's shared-memory transport (and its InfiniBand one) runs a reactor thread per process that
    busy-polls (``sched_yield`` in a loop) from ``init_rpc`` to shutdown, idle or not. Where processes
    outnumber cores, or each process is its own scheduling group (torchrun starts every worker in a session
    of its own), that thread takes the CPU share its process's real work needed: the gradient server scaled
    negatively (docs/server.md, "Performance"). Without ``busy_poll`` only TensorPipe's libuv (TCP) transport
    is offered, which sleeps in ``epoll``; the channels that move tensors (e.g. cross-memory attach between
    processes of one host) are unchanged.

    This is the one place pc passes an underscored torch argument (``_transports``, a keyword of the public
    ``TensorPipeRpcBackendOptions`` with no public equivalent); a torch without it keeps its defaults.
    """
    if busy_poll:
        return rpc.TensorPipeRpcBackendOptions(init_method=url, rpc_timeout=timeout)
    try:
        return rpc.TensorPipeRpcBackendOptions(
            init_method=url, rpc_timeout=timeout, _transports=[_EVENT_TRANSPORT]
        )
    except TypeError as exc:  # pragma: no cover - a torch whose options lost the argument
        logger.warning("TensorPipe options take no _transports (%r); keeping its default transports", exc)
        return rpc.TensorPipeRpcBackendOptions(init_method=url, rpc_timeout=timeout)


def init_rpc(name: str, rank: int, world_size: int, options: Any) -> None:
    """Run torch's ``init_rpc`` with TensorPipe's ``options`` (:func:`rpc_options`); no bound of its own.

    The caller bounds it (:func:`bounded_here`): its rendezvous on the store and TensorPipe's exchange of the
    workers' names have no deadline against a silent store.
    """
    with warnings.catch_warnings():
        # torch's own TensorPipe start-up gathers the worker names over a Backend it builds itself and then
        # warns about that deprecated use of its own API; nothing the caller can act on.
        warnings.filterwarnings(
            "ignore", message=r"You are using a Backend .* as a ProcessGroup", category=UserWarning
        )
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)  # type: ignore[no-untyped-call]


def shutdown_rpc_agent(graceful: bool, timeout: float) -> None:
    """Run torch's ``rpc.shutdown``: graceful (waiting at most ``timeout`` for the peers) or at once.

    Either kind then joins the RPC agent's threads, without a bound: the caller runs it on a helper thread.
    """
    if graceful:
        rpc.shutdown(graceful=True, timeout=timeout)
    else:
        rpc.shutdown(graceful=False)


# The elastic trainer's groups (``parallel.elastic``): one group per quorum, built like the pair links on a
# store scoped to the quorum, with no default process group. A broken gloo group is simply dropped; an NCCL
# group is aborted (its communicators hold device memory, and a kernel waiting for a dead peer only ends so).


def elastic_groups_available() -> bool:
    """Whether this torch build can make the elastic trainer's per-quorum groups (it has gloo)."""
    return _ProcessGroupGloo is not None


def quorum_group(store: Any, prefix: str, rank: int, size: int, timeout: float) -> Any:
    """A gloo process group of ``size`` members rendezvousing on ``store`` under the key prefix ``prefix``.

    Built with ``ProcessGroupGloo``'s constructor (as :func:`pair_link`), so no default group is needed and
    the group is private to its members: a member's death breaks this group only.

    Raises:
        RuntimeError: If this torch build has no gloo, or torch's error if a member does not arrive in time.
    """
    if _ProcessGroupGloo is None:
        raise RuntimeError("this torch build has no gloo, which the elastic trainer's groups need")
    return _ProcessGroupGloo(prefix_store(prefix, store), rank, size, timedelta(seconds=timeout))


def group_all_reduce_sum(group: Any, tensor: torch.Tensor, timeout: float) -> None:
    """Sum ``tensor`` in place over ``group`` (from :func:`quorum_group`), waiting at most ``timeout``."""
    group.allreduce([tensor]).wait(timedelta(seconds=timeout))


def group_broadcast(group: Any, tensor: torch.Tensor, root: int, timeout: float) -> None:
    """Broadcast ``tensor`` in place from group rank ``root`` of ``group``, waiting at most ``timeout``."""
    options = dist.BroadcastOptions()
    options.rootRank = root
    group.broadcast([tensor], options).wait(timedelta(seconds=timeout))


def nccl_quorum_groups_available() -> bool:
    """Whether this torch build can make NCCL quorum groups the elastic trainer can abort.

    Needs NCCL built in, its non-blocking communicator config (``ProcessGroupNCCL.NCCLConfig``) and an abort
    (``abort`` from torch 2.5, ``_shutdown`` on 2.4).
    """
    if _ProcessGroupNCCL is None or not dist.is_nccl_available():
        return False
    if not hasattr(_ProcessGroupNCCL, "NCCLConfig") or not hasattr(_ProcessGroupNCCL, "Options"):
        return False
    return _nccl_abort_name(_ProcessGroupNCCL) is not None


def _torch_release() -> tuple[int, int]:
    """This torch's (major, minor) release."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _nccl_abort_name(group_type: Any) -> str | None:
    """The method that aborts an NCCL group on this torch, or None.

    ``_shutdown`` is trusted only before torch 2.5, where it aborts; from 2.5 a shutdown is the graceful
    destroy, which waits for the peers.
    """
    if hasattr(group_type, "abort"):
        return "abort"
    if hasattr(group_type, "_shutdown") and _torch_release() < (2, 5):
        return "_shutdown"
    return None


def nccl_quorum_group(store: Any, prefix: str, rank: int, size: int, timeout: float) -> Any:
    """An NCCL process group of ``size`` members on ``store`` under ``prefix``, for :func:`abort_group`.

    The communicator is non-blocking (``config.blocking = 0``): its set-up returns at once instead of
    waiting inside NCCL for every peer, so a caller that gives up on a dead peer can abort it. torch makes
    the communicator at the group's first collective. The group's own timeout (its watchdog's, which ends
    the process when it fires) is set to twice ``timeout`` plus a minute: the caller bounds each collective
    by ``timeout`` and aborts the group first.

    Raises:
        RuntimeError: If this build cannot make such groups (:func:`nccl_quorum_groups_available`).
    """
    if not nccl_quorum_groups_available():
        raise RuntimeError(
            "this torch build has no abortable NCCL groups (NCCL with a non-blocking communicator config "
            "and an abort), which the elastic trainer's NCCL engine needs"
        )
    options = _ProcessGroupNCCL.Options()
    options.config.blocking = 0
    options._timeout = timedelta(seconds=2 * timeout + 60)
    return _ProcessGroupNCCL(prefix_store(prefix, store), rank, size, options)


def abort_group(group: Any) -> None:
    """Abort an NCCL group's communicators at once, without waiting for its peers (a dead peer never comes).

    torch 2.5 and later: ``abort()`` (their ``shutdown()`` is the graceful destroy, which waits for the
    peers); torch 2.4: ``_shutdown()``, which aborts. Collectives blocked in the group end with an error.

    Raises:
        RuntimeError: If ``group`` has no abort on this torch.
    """
    name = _nccl_abort_name(type(group))
    if name is None:
        raise RuntimeError(f"{type(group).__name__} has no abort on torch {torch.__version__}")
    getattr(group, name)()
