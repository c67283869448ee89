"""The chaos soak's world: 1 primary + 2 secondaries serve while client processes are SIGKILLed and restarted.

Members: '0' the primary (outside the secondary list) and the client host; '1' and '2' the secondaries; '3' a
client that is an RPC member itself and dies by SIGKILL from a timer thread (so mid-push) at a seeded moment:
its last push may be applied or not, never twice.

The host runs ``SLOTS`` client slots; each slot is a child process (plain Python, no torch, started with
``subprocess``) that produces integer gradients on request, and a host thread that pushes them to the
server under that incarnation's own accessor (its own ``client_id``). A seeded killer SIGKILLs a slot's child
at random moments, mostly while its push is in flight; the slot restarts with a new child and identity.
The RPC world's membership is fixed at start (a SIGKILLed member cannot rejoin), which is why restartable
clients push through the host.

Every gradient is an integer vector and the primary steps plain SGD with ``lr=1`` and ``reduce_method="sum"``,
so the final weights are exactly minus the sum of the applied pushes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import subprocess
import sys
import threading
from typing import Any

import torch
from torch import nn

from pc_server import PushPullGradServerImpl

WAIT_S = 60.0
SLOTS = 3
DIM = 8
_CHILD = (
    "import random, sys\n"
    "rng = random.Random(int(sys.argv[1]))\n"
    "for _ in sys.stdin:\n"  # exits on EOF: an orphan never outlives its host
    "    print(' '.join(str(rng.randint(-3, 3)) for _ in range(int(sys.argv[2]))), flush=True)\n"
)


class Vec(nn.Module):
    """One weight vector, zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(DIM, dtype=torch.float64))


class _Slot:
    """One client slot: its current child, the accessor of this incarnation and what the host saw."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.child: subprocess.Popen[str] | None = None
        self.pushing = threading.Event()
        self.lock = threading.Lock()


def _client_slot(slot: _Slot, group: Any, seed: int, stop: threading.Event, book: dict[str, Any]) -> None:
    incarnation = 0
    while not stop.is_set():
        incarnation += 1
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(seed * 1000 + slot.index * 100 + incarnation), str(DIM)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        with slot.lock:
            slot.child = child
        gs = group.get_paired("soak").to_here()  # a fresh accessor: a new client identity
        mine = book.setdefault(gs.client_id, {"accepted": 0, "refused": 0, "sum": [0] * DIM})
        model = Vec()
        try:
            while not stop.is_set():
                child.stdin.write("g\n")  # type: ignore[union-attr]
                child.stdin.flush()  # type: ignore[union-attr]
                line = child.stdout.readline()  # type: ignore[union-attr]  # '' once the child is killed
                if not line:
                    break
                grads = [int(x) for x in line.split()]
                model.w.grad = torch.tensor(grads, dtype=torch.float64)
                slot.pushing.set()  # the killer aims at this window
                try:
                    accepted = gs.push(model)
                finally:
                    slot.pushing.clear()
                if accepted:
                    mine["accepted"] += 1
                    mine["sum"] = [a + b for a, b in zip(mine["sum"], grads, strict=True)]
                else:
                    mine["refused"] += 1
        except (BrokenPipeError, OSError):
            pass  # the child died while we wrote to it
        finally:
            _reap(child)


def _reap(child: subprocess.Popen[str]) -> None:
    if child.poll() is None:
        child.kill()
    child.wait(timeout=WAIT_S)
    for stream in (child.stdin, child.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


def _killer(slots: list[_Slot], seed: int, stop: threading.Event, kills: list[int]) -> None:
    rng = random.Random(seed)
    while not stop.wait(rng.uniform(0.05, 0.4)):  # random moments; the wait also wakes at the end
        slot = rng.choice(slots)
        if rng.random() < 0.8:
            slot.pushing.wait(WAIT_S)  # mostly mid-push
        with slot.lock:
            child = slot.child
        if child is not None and child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            kills.append(slot.index)


def _usage() -> tuple[int, int]:
    import psutil

    me = psutil.Process()
    return me.memory_info().rss, me.num_threads()


def member_grads(seed: int) -> random.Random:
    """The gradient source of member '3' (the test replays it)."""
    return random.Random(seed * 7 + 3)


def _rpc_client(group: Any, seconds: float, seed: int, progress: str) -> None:
    """Member '3': push until a timer thread SIGKILLs this process; log each acknowledged push."""
    gs = group.get_paired("soak").to_here()
    fd = os.open(progress, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(fd, f"{gs.client_id}\n".encode())
    rng = member_grads(seed)
    delay = random.Random(seed).uniform(0.2, 0.8) * seconds
    threading.Timer(delay, os.kill, args=(os.getpid(), signal.SIGKILL)).start()
    model = Vec()
    acked = 0
    while True:  # ends with the kill; every push is bounded by the RPC timeout
        model.w.grad = torch.tensor([rng.randint(-3, 3) for _ in range(DIM)], dtype=torch.float64)
        if not gs.push(model):
            raise AssertionError("member 3's push was refused")
        acked += 1
        os.write(fd, f"{acked}\n".encode())  # one syscall: the kill never leaves half a line


def soak_world(rank: int, seconds: float, seed: int, progress: str) -> dict[str, Any]:
    """Serve (ranks 0-2), run the chaos (rank 0) or push until killed (rank 3); return what this rank saw."""
    torch.set_num_threads(1)
    from server_models import PlainSGD

    from pc_distributed import get_world

    world = get_world()
    assert world is not None
    group = world.create_rpc_group("soak", ["0", "1", "2", "3"])
    out: dict[str, Any] = {}
    if rank == 3:
        group.barrier(WAIT_S)  # the server is paired and started
        _rpc_client(group, seconds, seed, progress)
    live = world.create_rpc_group("live", ["0", "1", "2"])  # barriers without the member that dies
    impl = PushPullGradServerImpl(
        "soak",
        group,
        primary_reducer="0",
        secondary_reducers=["1", "2"],
        reduce_batch_size=2,
        max_queue_size=4096,
        flush_timeout=0.05,
    )
    if rank == 0:
        model = Vec()
        impl.manage_model(model, PlainSGD(model.parameters()))
    impl.start()
    group.barrier(WAIT_S)  # paired and started
    out["usage_start"] = _usage()
    if rank == 0:
        out.update(_chaos(group, seconds, seed))
    live.barrier(WAIT_S + seconds)  # the chaos is over (the reducers served meanwhile)
    out["usage_end"] = _usage()
    impl.stop(timeout=WAIT_S)
    impl.watch()
    live.barrier(WAIT_S)  # every reducer stopped
    if rank == 0:
        out["ledger"] = group.get_paired("soak").to_here().ledger()
        assert impl.model is not None
        out["weights"] = [int(x) for x in impl.model.w.detach().tolist()]
    live.barrier(WAIT_S)
    world.stop(timeout=5.0, graceful=False)  # member 3 is dead: a graceful shutdown would wait it out
    return out


def _chaos(group: Any, seconds: float, seed: int) -> dict[str, Any]:
    import psutil

    stop = threading.Event()
    slots = [_Slot(i) for i in range(SLOTS)]
    book: dict[str, Any] = {}
    kills: list[int] = []
    errors: list[str] = []

    def guarded(slot: _Slot) -> None:
        try:
            _client_slot(slot, group, seed, stop, book)
        except BaseException as exc:  # the server must keep serving: report, and end the soak
            errors.append(f"slot {slot.index}: {exc!r}")
            stop.set()

    threads = [threading.Thread(target=guarded, args=(s,), daemon=True) for s in slots]
    threads.append(threading.Thread(target=_killer, args=(slots, seed, stop, kills), daemon=True))
    for t in threads:
        t.start()
    try:
        stop.wait(seconds)  # the soak's duration
    finally:
        stop.set()
        for slot in slots:
            slot.pushing.set()  # wake the killer if it waits for a push
        for t in threads:
            t.join(WAIT_S)
        for slot in slots:
            with slot.lock:
                if slot.child is not None:
                    _reap(slot.child)
    return {
        "book": book,
        "kills": len(kills),
        "errors": errors,
        "alive_threads": [t.name for t in threads if t.is_alive()],
        "leftover_children": [p.pid for p in psutil.Process().children(recursive=True)],
    }


@dataclasses.dataclass
class SoakOutcome:
    """What the test checks, gathered from the ranks' results."""

    book: dict[str, Any]
    kills: int
    ledger: Any
    weights: list[int]
    usage: dict[int, tuple[tuple[int, int], tuple[int, int]]]
    member_id: str
    member_acked: int


def outcome(results: dict[int, dict[str, Any]], progress: str) -> SoakOutcome:
    host = results[0]
    assert not host["errors"], host["errors"]
    assert not host["alive_threads"], host["alive_threads"]
    assert not host["leftover_children"], host["leftover_children"]
    with open(progress) as fh:
        lines = fh.read().splitlines()
    return SoakOutcome(
        host["book"],
        host["kills"],
        host["ledger"],
        results[0]["weights"],
        {r: (results[r]["usage_start"], results[r]["usage_end"]) for r in (0, 1, 2)},
        lines[0],
        int(lines[-1]) if len(lines) > 1 else 0,
    )
