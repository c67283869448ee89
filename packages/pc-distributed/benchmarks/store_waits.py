"""How should one thread wait on the World's TCPStore without stalling the other threads? (issue 22)

A waiter thread waits for a key that a timer sets 1 s later; meanwhile the main thread makes 20 look-ups (one
``compare_set`` round trip each) on the shared client. For each way of waiting it prints the look-ups' median
and maximum latency and the waiter's wake-up delay after the key was set, then the cost of opening a client.
The numbers are quoted in ``docs/distributed.md``; pc-distributed uses "a client of its own" (pooled).
Last, the price of the bound on short requests (issue 20): ``compare_set`` round trips on the raw client and
through :class:`pc_distributed._store.BoundedStore` (a hand-off to its worker thread), interleaved.

Usage: ``python store_waits.py`` (one process, a few seconds; not part of ``run_all.py``).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from pc_distributed._store import BoundedStore

T = timedelta(seconds=30)
MASTER: Any = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=T, wait_for_workers=False)  # type: ignore[attr-defined]


def client() -> Any:
    """A new client connection to the store."""
    return dist.TCPStore(MASTER.host, MASTER.port, is_master=False, timeout=T, wait_for_workers=False)  # type: ignore[attr-defined]


SETTER = client()
SHARED = client()


def measure(name: str, waiter: Callable[[str], None]) -> None:
    """Run ``waiter`` in a thread while this thread makes look-ups on the shared client; print the numbers."""
    key = f"done/{name}"
    woke: dict[str, float] = {}
    set_at: dict[str, float] = {}
    started = threading.Event()

    def wait() -> None:
        started.set()
        waiter(key)
        woke["t"] = time.perf_counter()

    def set_key() -> None:
        set_at["t"] = time.perf_counter()
        SETTER.set(key, "1")

    thread = threading.Thread(target=wait)
    thread.start()
    started.wait()
    time.sleep(0.1)  # benchmark pacing only: let the waiter enter its wait
    timer = threading.Timer(1.0, set_key)
    timer.start()
    latencies = []
    for _ in range(20):
        t = time.perf_counter()
        SHARED.compare_set("k", "\x00absent", "\x00absent")
        latencies.append(time.perf_counter() - t)
    thread.join()
    timer.join()
    print(
        f"{name:34s} look-up median {statistics.median(latencies) * 1e3:8.3f} ms  "
        f"max {max(latencies) * 1e3:8.3f} ms  waiter wake-up {(woke['t'] - set_at['t']) * 1e3:7.3f} ms",
        flush=True,
    )


def sliced(seconds: float) -> Callable[[str], None]:
    """Wait on the shared client in slices of ``seconds``."""

    def wait(key: str) -> None:
        while True:
            try:
                SHARED.wait([key], timedelta(seconds=seconds))
                return
            except RuntimeError:
                continue

    return wait


def polled(key: str) -> None:
    """Poll the shared client with ``check`` every 10 ms."""
    while not SHARED.check([key]):
        time.sleep(0.01)


def bounded_overhead(rounds: int = 21, number: int = 200) -> None:
    """Median ``compare_set`` latency on the raw client and through a BoundedStore over the same client."""
    raw = client()
    bounded = BoundedStore(raw, 30.0, "bench store")
    fns = {"raw client": raw.compare_set, "BoundedStore": bounded.compare_set}
    samples: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        for name, fn in list(fns.items())[:: 1 if r % 2 == 0 else -1]:
            t, c = time.perf_counter(), time.process_time()
            for _ in range(number):
                fn("k", "\x00absent", "\x00absent")
            samples[name].append((time.perf_counter() - t) / number)
            cpu[name].append((time.process_time() - c) / number)
    bounded.close()
    for name in fns:
        print(
            f"short request ({name:13s}) median {statistics.median(samples[name]) * 1e6:8.1f} us wall, "
            f"{statistics.median(cpu[name]) * 1e6:8.1f} us CPU (process)",
            flush=True,
        )


def main() -> None:
    measure("one wait on the shared client", lambda key: SHARED.wait([key], T))
    measure("50 ms slices on the shared client", sliced(0.05))
    measure("200 ms slices on the shared client", sliced(0.2))
    measure("check every 10 ms on the shared client", polled)
    measure("a client of its own", lambda key: client().wait([key], T))
    keep = []
    for n in (1, 10, 50):
        t = time.perf_counter()
        keep.extend(client() for _ in range(n))
        print(f"opening {n:2d} more clients: {(time.perf_counter() - t) / n * 1e3:8.3f} ms each", flush=True)
    bounded_overhead()


if __name__ == "__main__":
    main()
