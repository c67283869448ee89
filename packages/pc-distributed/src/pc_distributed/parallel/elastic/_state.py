"""Handing a live member's training state to the members that are behind, over the quorum's group.

The state (the module's and the optimizer's ``state_dict`` and the committed step count) is serialised with
``torch.save`` into a uint8 host tensor (the engine stages it to the device where its groups need one); the
source broadcasts its size, then the bytes, and each receiver loads it onto its own device. Every member of
the quorum takes part (a broadcast is a collective); only the members named in ``sync`` load what they
receive.
No checkpoint file is written.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["share_state"]


def share_state(
    broadcast: Callable[[torch.Tensor, int], None],
    root: int,
    state: dict[str, Any] | None,
    device: torch.device,
) -> dict[str, Any]:
    """Broadcast ``state`` from group rank ``root``; return it on every member.

    Args:
        broadcast: ``broadcast(host_tensor, root)`` over the quorum's group, in place, bounded.
        root: The source's group rank.
        state: The state on the source, None elsewhere.
        device: Where this member's module lives: what the received state is loaded onto.
    """
    if state is not None:
        buf = io.BytesIO()
        torch.save(state, buf)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    broadcast(size, root)
    if state is None:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    broadcast(payload, root)
    if state is not None:
        return state
    loaded: dict[str, Any] = torch.load(
        io.BytesIO(payload.numpy().tobytes()), map_location=device, weights_only=False
    )
    return loaded
