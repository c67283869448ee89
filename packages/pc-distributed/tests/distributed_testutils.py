"""Helpers shared by the pc-distributed tests."""

from __future__ import annotations

import torch


def fork_unless_cuda() -> str:
    """``"fork"`` (fast start), or ``"spawn"`` where CUDA is available (a GPU machine's run).

    TensorPipe opens CUDA channels whenever CUDA is present, and CUDA cannot start in a child forked after the
    parent initialized its driver, so RPC would not start in a forked rank there (run_world refuses it).
    """
    return "spawn" if torch.cuda.is_available() else "fork"
