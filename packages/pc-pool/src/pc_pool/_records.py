"""Bookkeeping records of the process pool engine: jobs, chunks and worker handles (plain data, no logic)."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

__all__ = ["Chunk", "Job", "WorkerHandle"]


@dataclass(eq=False)
class Job:
    """One call of apply/map/imap: the function, its call mode and the result handle it fills."""

    id: int
    func: Callable[..., Any]
    mode: int
    result: Any
    func_blob: bytes | None = None  # copy mode: dumped once per job, reused for every worker
    func_error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(eq=False)
class Chunk:
    """A slice of a job's elements; ``slot`` pins it to a worker index (P2PPool), ``sent`` once it left."""

    job: Job
    index: int
    items: list[Any]
    slot: int | None = None
    sent: bool = False
    nbytes: int = 0  # bytes this chunk took in the task pipe
    sent_at: float = 0.0
    # Share mode: the payloads sent (arguments, and the function if it rode along), kept until the chunk is
    # answered, so that the pool can release them if the worker never reads them (see _serial.release).
    sent_payloads: tuple[bytes | None, ...] = ()


@dataclass(eq=False)
class WorkerHandle:
    """The parent's view of one worker process and its two pipes."""

    index: int
    process: BaseProcess
    task_conn: Connection
    result_conn: Connection
    reader: Any = None  # its ResultReader (every parent-side read of result_conn goes through it)
    outstanding: collections.deque[Chunk] = field(default_factory=collections.deque)
    sent_jobs: set[int] = field(default_factory=set)
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    ready: bool = False
    window: int = 2  # chunks it may have outstanding (deeper while it answers fast, see _settings.FAST_RTT)
    refill: int = 1  # its feeder sends again once this many or fewer are outstanding
    service: float | None = None  # moving average of its seconds per chunk
    last_reply_at: float = 0.0
    answered: int = 0
    direct: bool = False  # a caller thread is sending a chunk to this idle worker itself (feeder keeps off)
    retiring: bool = False
    exit_sent: bool = False
    dead: bool = False
