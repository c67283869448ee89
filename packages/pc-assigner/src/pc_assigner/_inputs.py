"""Checking and normalising ``ModelAssigner``'s arguments: devices, numbers, per-device mappings."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["DeviceLike", "check_number", "per_device", "to_device"]

DeviceLike = torch.device | str | int
"""Anything ``torch.device(...)`` accepts."""


def to_device(d: Any) -> torch.device:
    """``torch.device(d)``, with ``"cuda"`` read as ``"cuda:0"`` and ``"cpu:N"`` as ``"cpu"``."""
    if isinstance(d, bool) or not isinstance(d, (torch.device, str, int)):
        raise TypeError(f"a device must be a torch.device, str or int, got {type(d).__name__} ({d!r})")
    try:
        dev = torch.device(d)
    except RuntimeError as exc:
        raise ValueError(f"not a device: {d!r} ({exc})") from exc
    index: int | None = dev.index  # None for "cuda" without an ordinal (the stubs say int)
    if dev.type != "cpu" and index is None:
        dev = torch.device(dev.type, 0)
    if dev.type == "cpu":
        dev = torch.device("cpu")  # "cpu:0" and "cpu" are one device
    return dev


def check_number(name: str, v: Any, *, positive: bool = False) -> float:
    """``v`` as a finite float >= 0 (> 0 with ``positive``); the error names ``name``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(v).__name__} ({v!r})")
    f = float(v)
    if not math.isfinite(f) or f < 0 or (positive and f == 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {v!r}")
    return f


def per_device(name: str, value: Any, devices: list[torch.device]) -> dict[torch.device, float]:
    """A ``{device: number}`` mapping or a list aligned with ``devices`` -> dict over some ``devices``."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        out: dict[torch.device, float] = {}
        for k, v in value.items():
            dev = to_device(k)
            if dev not in devices:
                raise ValueError(
                    f"{name} names {k!r}, which is not among the devices {[str(d) for d in devices]}"
                )
            out[dev] = check_number(f"{name}[{k!r}]", v)
        return out
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != len(devices):
            raise ValueError(
                f"{name} as a list must have one entry per device ({len(devices)}), got {len(value)}"
            )
        pairs = zip(devices, value, strict=True)
        return {d: check_number(f"{name}[{i}]", v) for i, (d, v) in enumerate(pairs)}
    raise TypeError(
        f"{name} must be a mapping {{device: number}} or a list aligned with devices, "
        f"got {type(value).__name__}"
    )
