"""What a c10d transport knows about another member: its link, lane, receiver threads and state.

One :class:`Peer` per other member, made when the transport starts and kept for its lifetime (a lost peer
stays lost).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any

from pc_distributed.rpc._c10d.frames import Prediction
from pc_distributed.rpc._c10d.lane import Lane

__all__ = ["Peer"]


@dataclass(eq=False)
class Peer:
    """What this member knows about another: its lane, and whether frames may still go or come."""

    rank: int
    name: str
    link: Any  # the pair's process group
    link_rank: int  # the peer's rank in it
    lane: Lane  # waits for the sends posted to it that no caller waits for
    post_lock: threading.Lock = field(default_factory=threading.Lock)  # frames are posted one at a time
    receivers: list[threading.Thread] = field(default_factory=list)  # the two that take turns receiving
    turn: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)  # receiving handed on, or STOP
    waiting_turns: int = 0  # receiver threads waiting for the turn (under the transport's lock)
    receiver_done: threading.Event = field(default_factory=threading.Event)  # receiving from it has ended
    predicted: int | None = None  # the size it has posted ahead for our next parts (under post_lock)
    prediction: Prediction | None = None  # our receive posted ahead for its next parts (its receivers')
    said_bye: bool = False  # our goodbye is posted: nothing more goes to it (set under post_lock)
    heard_bye: bool = False  # its goodbye arrived: nothing more comes from it
    lost: str | None = None  # why it is unreachable, once it is
    last_sent: float = 0.0
    last_heard: float = 0.0

    @property
    def gone(self) -> bool:
        """Whether nothing more can come from it (it said goodbye, or it is lost)."""
        return self.heard_bye or self.lost is not None
