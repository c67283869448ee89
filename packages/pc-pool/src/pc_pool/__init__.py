"""Process and thread pools for PyTorch that run lambdas, share tensors and never hang."""

from pc_pool.__about__ import __version__

__all__ = ["__version__"]
