"""Dill-compatible pickling of lambdas, modules and tensors, copied or shared through shared memory and CUDA IPC."""

from pc_pickle.__about__ import __version__

__all__ = ["__version__"]
