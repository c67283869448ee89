"""Ordered key-value, model and gradient parameter servers over pc-distributed RpcGroups."""

from pc_server.__about__ import __version__

__all__ = ["__version__"]
