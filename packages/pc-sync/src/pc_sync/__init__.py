"""SyncMaster/SlavePipe and synchronized batch norm across DataParallel replicas that never deadlocks."""

from pc_sync.__about__ import __version__

__all__ = ["__version__"]
