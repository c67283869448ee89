"""Small helpers for the pc-replicate tests (torch.testing is slow to import on a loaded machine)."""

from __future__ import annotations

import torch


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-6, msg: str = "") -> None:
    """Assert same shape and dtype, and ``|actual - expected| <= atol`` elementwise."""
    assert actual.shape == expected.shape, f"{msg} shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{msg} dtype {actual.dtype} != {expected.dtype}"
    diff = (actual.detach() - expected.detach()).abs().max().item() if actual.numel() else 0.0
    assert diff <= atol, f"{msg} max abs difference {diff} > {atol}"
