"""A harness for the c10d transport tests: N processes, a gloo link per pair, a transport per process.

Unlike ``run_world``, which stops every rank when one dies, the harness lets a test kill a rank and watch the
others carry on: each rank reports its result (or its error) over its own pipe, and a rank may be expected
to die. The rendezvous store is a ``TCPStore`` served by the test process on a free port (port 0); the
ranks also use it for the tests' own synchronisation (keys, never sleeps).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from pc_distributed._torch_dist import link_devices, pair_link
from pc_distributed.rpc._c10d.transport import C10dTransport

DIED = "<died>"  # the result of a rank that was expected to die and did


def store_barrier(store: Any, name: str, ranks: list[int], rank: int, timeout: float = 60.0) -> None:
    """Wait until every rank of ``ranks`` reached the barrier ``name`` (keys in the store, no sleeps)."""
    store.set(f"barrier/{name}/{rank}", "1")
    store.wait([f"barrier/{name}/{r}" for r in ranks], timedelta(seconds=timeout))


def make_links(
    store: Any,
    rank: int,
    world_size: int,
    link_timeout: float,
    prefix: str = "links",
    shared_device: bool = True,
) -> dict[int, Any]:
    """This rank's link to every other rank (a gloo group of two each), as the World makes them.

    ``shared_device``: the links share one gloo device, as the backend's do where torch allows; else each
    link makes its own (what the backend does on a torch without gloo's group options).
    """
    scoped = dist.PrefixStore(prefix, store)
    devices = link_devices() if shared_device else None
    return {r: pair_link(scoped, rank, r, link_timeout, devices) for r in range(world_size) if r != rank}


def _child(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    conn: Connection,
    link_timeout: float,
    barrier: bool,
    workers: int,
    shared_device: bool,
) -> None:
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timedelta(seconds=60))
        transport = C10dTransport(
            make_links(store, rank, world_size, link_timeout, shared_device=shared_device),
            rank,
            [f"w{r}" for r in range(world_size)],
            timeout=30.0,
            link_timeout=link_timeout,
            workers=workers,
        )
        try:
            result = fn(rank, transport, store, *args)
            if barrier:
                store_barrier(store, "end", list(range(world_size)), rank)
        finally:
            transport.shutdown(timeout=20)
        conn.send(("ok", result))
    except BaseException as exc:
        conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    timeout: float = 150.0,
    link_timeout: float = 10.0,
    barrier: bool = True,
    may_die: tuple[int, ...] = (),
    workers: int = 8,
    shared_device: bool = True,
) -> list[Any]:
    """Run ``fn(rank, transport, store, *args)`` in ``world_size`` processes; their results by rank.

    A rank in ``may_die`` that dies gives :data:`DIED`; any other failure raises ``AssertionError`` with the
    rank's traceback. Every process is gone when this returns (killed after ``timeout``).
    """
    # spawn, not fork: this process serves the store, and a child forked while the store's server thread runs
    # can hang in torch's C++ before its rendezvous (seen in CI: a rank never joined init_process_group)
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, True, timedelta(seconds=60), wait_for_workers=False)
    procs, conns = [], []
    for rank in range(world_size):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_child,
            args=(
                rank,
                world_size,
                store.port,
                fn,
                args,
                child,
                link_timeout,
                barrier,
                workers,
                shared_device,
            ),
            name=f"c10d-rank-{rank}",
        )
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        waiting = {conns[r]: r for r in range(world_size)}
        while waiting and time.monotonic() < deadline:
            for conn in wait(list(waiting), timeout=max(0.0, deadline - time.monotonic())):
                rank = waiting.pop(conn)  # type: ignore[call-overload]
                try:
                    status, value = conn.recv()  # type: ignore[union-attr]
                except EOFError:
                    status, value = "died", None
                if status == "ok":
                    results[rank] = value
                elif status == "died" and rank in may_die:
                    results[rank] = DIED
                else:
                    errors[rank] = value if status == "err" else "died without a result"
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        for conn in conns:
            conn.close()
        del store
    if errors:
        raise AssertionError("\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise AssertionError(f"ranks {missing} gave no result within {timeout} s")
    return [results[r] for r in range(world_size)]


def pid() -> int:
    """This process's id (a function the tests send to other ranks)."""
    return os.getpid()


def _all_threads_stopped(pid: int) -> bool:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True  # gone: nothing of it runs
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            continue  # the thread ended
        if state not in ("T", "t"):
            return False
    return True


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped.

    ``kill`` only queues the signal: a thread running on another CPU can go on (and answer a call) for a
    moment after it returns. The kernel offers no wake-up for a stop, so the state is polled until
    ``timeout``, then ``TimeoutError``.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not _all_threads_stopped(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} was not stopped {timeout:g} s after SIGSTOP")
        time.sleep(0.001)
