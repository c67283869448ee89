"""DataParallel with replication callbacks, CPU thread replicas, and a threaded Parallel."""

from pc_replicate.__about__ import __version__

__all__ = ["__version__"]
