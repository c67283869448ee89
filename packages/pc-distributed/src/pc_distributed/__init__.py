"""World, CollectiveGroup and RpcGroup on torch.distributed with timeouts everywhere, a local launcher, DataParallel and DASO."""

from pc_distributed.__about__ import __version__

__all__ = ["__version__"]
