"""run_world: start a local world of processes, run a function on every rank, return the results by rank.

    parent                                    child rank r (spawned)
    ------                                    ----------------------
    TCPStore on 127.0.0.1:0 (free port)  <--  World(name=str(r)) as a client of that store
    Pipe r  <-------------------------------  (OK, result) | (ERR, exception, traceback)
    wait(pipes + sentinels, deadline)         send the result, then World.stop(), then exit

The parent owns the store, so there is no bind race between picking a port and using it. It waits on the pipes
and the process sentinels: a rank's exception or death is noticed at once; the other ranks then get a short
grace period to finish before they are killed, and the first failure is re-raised with its original type,
naming the rank, with the remote traceback as ``__cause__``. At the deadline every process is killed and a
``TimeoutError`` names the ranks still running.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import signal
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pc_distributed import _store
from pc_distributed._checks import positive_int, positive_seconds
from pc_distributed._errors import (
    RankDiedError,
    add_note,
    format_exception,
    portable_exception,
    reraise_remote,
)
from pc_distributed.rpc._backends import choose_backend

__all__ = ["run_world"]

logger = logging.getLogger(__name__)

_OK = 0
_ERR = 1
_GRACE_S = 5.0


@dataclass(frozen=True)
class _RankJob:
    """What every rank process runs: ``fn(rank, *args)`` inside its World, the result sent to the parent.

    Args:
        fn: The user's function.
        args: Its arguments after the rank.
        world_size: Number of ranks.
        env: The rendezvous variables every rank shares (``RANK``/``LOCAL_RANK`` are added per rank).
        world_kwargs: Keyword arguments of each rank's :class:`~pc_distributed.World`.
        deadline_wall: ``time.time()`` by which ``run_world`` gives up (bounds the World's stop).
        inherited_fd: The store's listening socket, which a forked rank inherits and closes (None: not
            inherited).
    """

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    world_size: int
    env: dict[str, str]
    world_kwargs: dict[str, Any]
    deadline_wall: float
    inherited_fd: int | None = None

    def run(self, rank: int, conn: Any) -> None:
        """The rank process's body: start the World, run ``fn``, send the result on ``conn``, stop."""
        if self.inherited_fd is not None:
            os.close(self.inherited_fd)  # the parent's store listens on it: a copy here would outlive it
        os.environ.update({**self.env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
        from pc_distributed.world.world import World

        message: tuple[Any, ...]
        world: World | None = None
        ok = False
        try:
            try:
                world = World(name=str(rank), rank=rank, world_size=self.world_size, **self.world_kwargs)
                message = (_OK, self.fn(rank, *self.args))
                ok = True
            except BaseException as exc:
                message = (_ERR, portable_exception(exc), format_exception(exc))
            # The result goes to the parent before the World stops: a graceful stop waits for every peer,
            # and a peer that died would otherwise cost this rank its result when the parent's grace period
            # runs out.
            _send(conn, rank, message)
        finally:
            conn.close()
            if world is not None:
                try:
                    world.stop(timeout=max(1.0, self.deadline_wall - time.time()), graceful=ok)
                except BaseException as exc:  # pragma: no cover - stop() is bounded and catches its errors
                    logger.warning("rank %d: World.stop failed: %r", rank, exc)


def _send(conn: Any, rank: int, message: tuple[Any, ...]) -> None:
    # Plain pickle, not the connection's ForkingPickler: that one would share tensors through file descriptors
    # which the parent fetches from this process, possibly after it has exited. Plain pickle copies by value.
    try:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # the result did not pickle
        error = TypeError(f"rank {rank}'s result could not be sent: {exc}")
        payload = pickle.dumps((_ERR, error, format_exception(exc)), protocol=pickle.HIGHEST_PROTOCOL)
    conn.send_bytes(payload)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _loopback_env() -> dict[str, str]:
    env: dict[str, str] = {}
    if any(name == "lo" for _, name in socket.if_nameindex()):
        for key in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME"):
            if key not in os.environ:
                env[key] = "lo"
    return env


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout: float = 300.0,
    backend: str | None = None,
    init_dist: bool = True,
    init_rpc: bool = True,
    start_method: str = "spawn",
    dist_timeout: float = 60.0,
    rpc_timeout: float = 60.0,
    grace_period: float = _GRACE_S,
    rpc_backend: str = "auto",
    dist_backend: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, *args)`` in a fresh local world of ``world_size`` processes; return the results by rank.

    Each process builds ``World(name=str(rank), rank=rank, world_size=world_size, ...)`` on free loopback
    ports (the parent serves the store on port 0), calls ``fn``, sends its result back and stops its World
    (also on error). ``fn`` and ``args`` are pickled by reference, so ``fn`` must be a module-level function
    (test modules are fine: spawned children get the parent's ``sys.path``).

    Args:
        fn: ``fn(rank, *args)``, run on every rank.
        world_size: Number of processes (>= 1).
        args: Extra positional arguments for ``fn``.
        timeout: Seconds for the whole run; then every process is killed.
        backend: The older name of ``dist_backend`` (give one of the two).
        init_dist: Create the default process group in each World.
        init_rpc: Initialise RPC in each World.
        start_method: ``"spawn"`` (default), ``"forkserver"`` or ``"fork"``.
        dist_timeout: Each World's ``dist_timeout``.
        rpc_timeout: Each World's ``rpc_timeout``.
        grace_period: Seconds the other ranks get to finish after a rank failed, before they are killed.
        rpc_backend: Each World's ``rpc_backend`` (``"tensorpipe"``, ``"c10d"``, ``"auto"``), resolved here
            once so that every rank uses the same.
        dist_backend: Each World's ``dist_backend``: the process-group backend (``"gloo"``, the default, or
            ``"nccl"``), named as ``World`` names it.

    Returns:
        ``[fn(0, *args), fn(1, *args), ...]``.

    Raises:
        TypeError: If ``fn`` is not picklable by reference, an argument has the wrong type, or both
            ``backend`` and ``dist_backend`` are given.
        ValueError: If an argument is out of range, ``rpc_backend`` names no backend, or
            ``start_method="fork"`` with TensorPipe's RPC where CUDA is available (forked ranks cannot start
            it).
        Exception: The first failing rank's exception, with its original type where it pickles (else a
            ``RuntimeError``), a note naming the rank and the remote traceback as ``__cause__``.
        RankDiedError: If a rank died (signal or ``os._exit``) before returning.
        TimeoutError: If ranks were still running at the deadline; the message names them.

    A failure raised here carries ``run_world_results``: a dict of the results of the ranks that did return,
    by rank (e.g. the survivors of a killed worker).

    Examples:
        >>> def hello(rank: int) -> str:
        ...     return f"rank {rank} of {pc_distributed.get_world().world_size}"
        >>> run_world(hello, 2)  # doctest: +SKIP
        ['rank 0 of 2', 'rank 1 of 2']
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise TypeError(
            f"fn must be picklable by reference (a module-level function), got {fn!r}: {exc}"
        ) from None
    positive_int("world_size", world_size)
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    timeout = positive_seconds("timeout", timeout)
    grace_period = positive_seconds("grace_period", grace_period)
    if start_method not in mp.get_all_start_methods():
        raise ValueError(f"start_method must be one of {mp.get_all_start_methods()}, got {start_method!r}")
    rpc_backend = choose_backend(rpc_backend)
    if start_method == "fork" and init_rpc and rpc_backend == "tensorpipe" and torch.cuda.is_available():
        # TensorPipe's RPC agent opens CUDA channels whenever CUDA is present, and CUDA cannot start in a
        # child forked after the parent's driver was initialized (torch.cuda.is_available() does that): every
        # rank's init_rpc would fail with CUDA_ERROR_NOT_INITIALIZED. Refuse before anything starts.
        raise ValueError(
            "start_method='fork' with init_rpc=True on a machine with CUDA: forked ranks cannot start "
            "TensorPipe's RPC there. Use start_method='spawn' (the default) or 'forkserver', or "
            "rpc_backend='c10d'"
        )
    if backend is not None and dist_backend is not None:
        raise TypeError(
            f"give dist_backend or backend (its older name), not both: got dist_backend={dist_backend!r} "
            f"and backend={backend!r}"
        )
    world_kwargs = {
        "dist_backend": next((b for b in (dist_backend, backend) if b is not None), "gloo"),
        "init_dist": bool(init_dist),
        "init_rpc": bool(init_rpc),
        "dist_timeout": positive_seconds("dist_timeout", dist_timeout),
        "rpc_timeout": positive_seconds("rpc_timeout", rpc_timeout),
        "rpc_backend": rpc_backend,
    }
    ctx: Any = mp.get_context(start_method)
    # The ranks start before the store serves (they wait in the listen backlog): a child forked while the
    # store's server thread runs can inherit one of its locks held and hang in its own store client.
    fd, port = _store.listen_socket("127.0.0.1", 0)
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        **_loopback_env(),
    }
    start = time.monotonic()
    deadline = start + timeout
    deadline_wall = time.time() + timeout
    inherited = fd if start_method == "fork" else None
    if start_method == "fork":
        # Garbage the caller has not collected yet (objects in reference cycles) would be collected in the
        # forked ranks, whose copies of the caller's threads do not exist: a gloo process group's destructor
        # waits for its worker threads and hangs there. Collected here, its destructors run where the threads
        # live.
        gc.collect()
    job = _RankJob(fn, tuple(args), world_size, env, world_kwargs, deadline_wall, inherited)
    procs: list[Any] = []
    conns: list[Any] = []
    finished = False
    store: Any = None
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=job.run, args=(rank, writer), name=f"pc-world-rank-{rank}")
            proc.start()
            writer.close()
            procs.append(proc)
            conns.append(reader)
        listening, fd = fd, -1  # serve_store owns it from here on, and closes it if it fails
        store = _store.serve_store("127.0.0.1", port, listening, world_size, timeout)
        results = _collect(procs, conns, deadline, timeout, grace_period)
        finished = True
        return results
    finally:
        if fd >= 0:  # the store never took it
            os.close(fd)
        _reap(procs, patient=finished)
        for conn in conns:
            conn.close()
        del store


def _collect(procs: list[Any], conns: list[Any], deadline: float, timeout: float, grace: float) -> list[Any]:
    results: dict[int, Any] = {}
    failures: list[tuple[int, BaseException]] = []
    pending = set(range(len(procs)))
    open_conns = {r: conns[r] for r in pending}
    grace_end: float | None = None

    def record(rank: int, message: tuple[Any, ...]) -> None:
        pending.discard(rank)
        if message[0] == _OK:
            results[rank] = message[1]
        else:
            failures.append((rank, reraise_remote(message[1], message[2], f"rank {rank}")))

    while pending:
        limit = deadline if grace_end is None else min(deadline, grace_end)
        remaining = limit - time.monotonic()
        if remaining <= 0:
            break
        waitables: list[Any] = [open_conns[r] for r in pending if r in open_conns]
        waitables += [procs[r].sentinel for r in pending]
        ready = set(mpc.wait(waitables, timeout=remaining))
        for rank in sorted(pending):
            conn = open_conns.get(rank)
            if conn is not None and (conn in ready or procs[rank].sentinel in ready):
                try:
                    if conn in ready or conn.poll():
                        record(rank, pickle.loads(conn.recv_bytes()))
                        continue
                except (EOFError, OSError):
                    open_conns.pop(rank, None)
            if procs[rank].sentinel in ready and rank in pending:
                procs[rank].join(5.0)  # the sentinel fires as the process exits
                code = procs[rank].exitcode
                pending.discard(rank)
                failures.append(
                    (
                        rank,
                        RankDiedError(
                            rank, code, f"rank {rank} {_exit_text(code)} before returning a result"
                        ),
                    )
                )
        if failures and grace_end is None:
            grace_end = time.monotonic() + grace
    if failures:
        rank, exc = failures[0]
        notes = [f"rank {r}: {type(e).__name__}: {e}" for r, e in failures[1:]]
        if pending:
            notes.append(f"ranks {sorted(pending)} were killed after the failure of rank {rank}")
        if notes:
            add_note(exc, "other ranks: " + "; ".join(notes))
        exc.run_world_results = dict(results)  # type: ignore[attr-defined]
        raise exc
    if pending:
        raise TimeoutError(f"run_world timed out after {timeout:g} s; ranks still running: {sorted(pending)}")
    return [results[r] for r in range(len(procs))]


def _reap(procs: list[Any], patient: bool) -> None:
    """Let finished ranks exit (``patient``), else SIGTERM, then SIGKILL; never returns with a child alive."""
    if patient:
        end = time.monotonic() + 10.0
        for proc in procs:
            proc.join(max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
    for proc in procs:
        if not proc.is_alive():
            proc.close()
