"""One synchronized layer's exchange round on CPU thread replicas, beside minimal exchanges of the same data.

Every variant carries what a ``SynchronizedBatchNorm2d`` replica sends (a tuple of per-channel tensors of a
tiny layer, its count and dtype) and answers every replica with one shared reply, as the layer's master does.
The reduction itself does no arithmetic, so what is timed is the exchange alone: the hand-off of the messages
to the master thread and of the replies back to the replica threads.

- ``pc_sync.SyncMaster``: ``run_master`` / ``SlavePipe.run_slave`` with their timeouts, id checks, reply
  checks and abort;
- bare hand-off (the baseline): a ``queue.SimpleQueue`` to the master and one lock per replica back, with
  nothing checked and no error that names anybody -- the least a master/slave exchange on Python threads
  costs, the floor the checks of ``SyncMaster`` are measured against;
- ``threading.Barrier``: the messages in shared slots, one ``wait`` for the messages in and one for the
  replies out.

Run alone: ``python packages/pc-sync/benchmarks/exchange_round.py [--quick]`` (``run.py`` reports it too).
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from pc_sync import SlavePipe, SyncMaster

__all__ = ["VARIANTS", "exchange_round_us"]

_WAIT = 60.0  # every wait of every variant is bounded


def _same_reply(msgs: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """A layer master's answer without its arithmetic: one shared reply for every replica."""
    reply = msgs[0][1]
    return [(ident, reply) for ident, _ in msgs]


def _messages(participants: int, channels: int = 8) -> list[tuple[Any, ...]]:
    """One replica message per participant: ``(mean, M2, count, dtype)`` of a tiny layer."""
    return [(torch.zeros(channels), torch.zeros(channels), 4, torch.float32) for _ in range(participants)]


Exchange = tuple[Callable[[Any], Any], list[Callable[[Any], Any]]]
"""The master's call and one call per slave, each taking this round's message and returning its reply."""


def _sync_master(participants: int) -> Exchange:
    master = SyncMaster(_same_reply)
    pipes = [master.register_slave(k) for k in range(1, participants)]

    def run_master(msg: Any) -> Any:
        return master.run_master(msg, timeout=_WAIT)

    def slave(pipe: SlavePipe) -> Callable[[Any], Any]:
        return lambda msg: pipe.run_slave(msg, timeout=_WAIT)

    return run_master, [slave(p) for p in pipes]


def _bare(participants: int) -> Exchange:
    inbox: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
    replies: list[Any] = [None] * participants
    ready = [threading.Lock() for _ in range(participants)]
    for lock in ready:
        lock.acquire()

    def run_master(msg: Any) -> Any:
        msgs: list[tuple[Any, Any]] = [(0, msg)]
        msgs.extend(sorted((inbox.get(True, _WAIT) for _ in range(participants - 1)), key=lambda m: m[0]))
        for ident, reply in _same_reply(msgs)[1:]:
            replies[ident] = reply
            ready[ident].release()
        return msgs[0][1]

    def slave(k: int) -> Callable[[Any], Any]:
        def run_slave(msg: Any) -> Any:
            inbox.put((k, msg))
            if not ready[k].acquire(True, _WAIT):
                raise TimeoutError(f"bare hand-off: replica {k} got no reply")
            return replies[k]

        return run_slave

    return run_master, [slave(k) for k in range(1, participants)]


def _barrier(participants: int) -> Exchange:
    barrier = threading.Barrier(participants)
    slots: list[Any] = [None] * participants
    replies: list[Any] = [None] * participants

    def run_master(msg: Any) -> Any:
        slots[0] = msg
        barrier.wait(_WAIT)
        for ident, reply in _same_reply(list(enumerate(slots))):
            replies[ident] = reply
        barrier.wait(_WAIT)
        return replies[0]

    def slave(k: int) -> Callable[[Any], Any]:
        def run_slave(msg: Any) -> Any:
            slots[k] = msg
            barrier.wait(_WAIT)
            barrier.wait(_WAIT)
            return replies[k]

        return run_slave

    return run_master, [slave(k) for k in range(1, participants)]


VARIANTS: dict[str, Callable[[int], Exchange]] = {
    "pc_sync.SyncMaster": _sync_master,
    "bare hand-off (queue + locks)": _bare,
    "threading.Barrier (2 waits)": _barrier,
}
BASELINE = "bare hand-off (queue + locks)"


def _seconds_per_round(make: Callable[[int], Exchange], participants: int, rounds: int) -> float:
    """Wall seconds per round of the master's loop, with ``participants - 1`` slave threads."""
    msgs = _messages(participants)
    run_master, slaves = make(participants)
    failures: list[BaseException] = []

    def slave_loop(run_slave: Callable[[Any], Any], msg: Any) -> None:
        try:
            for _ in range(rounds):
                run_slave(msg)
        except BaseException as exc:  # reported below: a broken variant must not pass as fast
            failures.append(exc)

    threads = [
        threading.Thread(target=slave_loop, args=(s, msgs[k]), daemon=True) for k, s in enumerate(slaves, 1)
    ]
    for t in threads:
        t.start()
    start = time.perf_counter()
    for _ in range(rounds):
        run_master(msgs[0])
    elapsed = time.perf_counter() - start
    for t in threads:
        t.join(_WAIT)
    if failures or any(t.is_alive() for t in threads):
        raise RuntimeError(f"exchange benchmark: a slave failed or hung: {failures!r}")
    return elapsed / rounds


def exchange_round_us(
    participants: int, rounds: int, repeat: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Every variant's median microseconds per round, and its median ratio to the baseline's.

    The variants are timed round-robin (in alternating order) in one run, and the ratio is taken within each
    repeat before its median, so a change of the machine's state between repeats (other jobs, where the
    scheduler puts the threads) hits both sides of every ratio alike.
    """
    samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
    order = list(VARIANTS.items())
    for make in VARIANTS.values():  # warm-up: imports, first thread starts, allocator
        _seconds_per_round(make, participants, max(1, rounds // 10))
    for r in range(repeat):
        for name, make in order if r % 2 == 0 else order[::-1]:
            samples[name].append(_seconds_per_round(make, participants, rounds) * 1e6)
    medians = {name: statistics.median(s) for name, s in samples.items()}
    base = samples[BASELINE]
    ratios = {
        name: statistics.median(v / b for v, b in zip(s, base, strict=True)) for name, s in samples.items()
    }
    return medians, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and repeats")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds, repeat = (300, 5) if args.quick else (2000, 15)
    for n in (2, 4):
        us, ratios = exchange_round_us(n, rounds, repeat)
        for name, value in us.items():
            print(f"{n} replicas  {name:32} {value:8.1f} us/round  {ratios[name]:6.3f}x")


if __name__ == "__main__":
    main()
