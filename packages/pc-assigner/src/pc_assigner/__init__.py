"""Deterministic, memory-safe placement of PyTorch modules on devices."""

from pc_assigner.__about__ import __version__

__all__ = ["__version__"]
