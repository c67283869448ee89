"""Helpers shared by the pc-distributed tests."""

from __future__ import annotations

import torch


def fork_unless_cuda() -> str:
    """``"fork"`` (fast start), or ``"spawn"`` once this process has initialized CUDA (a GPU machine's run).

    A forked child cannot use an inherited CUDA context and TensorPipe opens CUDA channels whenever CUDA is
    present, so RPC would not start in a forked rank there.
    """
    return "spawn" if torch.cuda.is_initialized() else "fork"
