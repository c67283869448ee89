"""Threads for the pc-sync protocol tests: run callables, collect each one's value or exception."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["JOIN", "Runner"]

JOIN = 30.0  # generous bound on every join: "arrived rather than hung"


class Runner:
    """Run callables in threads; collect (value or exception) per name."""

    def __init__(self) -> None:
        self.results: dict[Hashable, Any] = {}
        self.errors: dict[Hashable, BaseException] = {}
        self.threads: list[threading.Thread] = []

    def start(self, name: Hashable, fn: Callable[[], Any]) -> None:
        def target() -> None:
            try:
                self.results[name] = fn()
            except BaseException as exc:
                self.errors[name] = exc

        t = threading.Thread(target=target, daemon=True)
        self.threads.append(t)
        t.start()

    def join(self, timeout: float = JOIN) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t for t in self.threads if t.is_alive()]
        assert not alive, f"{len(alive)} thread(s) still waiting after {timeout} s"
