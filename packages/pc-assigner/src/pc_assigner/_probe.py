"""Device discovery and free-memory probes, read once when an assigner is built (never at import).

* CUDA: ``torch.cuda.mem_get_info(i)[0]`` (free bytes; torch's ordinals respect
  ``CUDA_VISIBLE_DEVICES``). This creates a CUDA context on each probed device.
* CPU: ``psutil.virtual_memory().available`` when psutil is importable, else ``MemAvailable`` from
  ``/proc/meminfo``, else ``os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")``.
"""

from __future__ import annotations

import logging
import os

import torch

__all__ = ["cpu_available_bytes", "default_devices", "probe_memory"]

logger = logging.getLogger(__name__)


def default_devices() -> list[torch.device]:
    """Every visible CUDA device, then the CPU."""
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [torch.device("cuda", i) for i in range(cuda)] + [torch.device("cpu")]


def cpu_available_bytes() -> int:
    """Bytes of memory available to a new allocation on this host."""
    try:
        import psutil
    except ImportError:
        pass
    else:
        return int(psutil.virtual_memory().available)
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))


def probe_memory(device: torch.device) -> int:
    """Free memory of ``device`` in bytes.

    Raises:
        ValueError: for device types other than ``cpu`` and ``cuda`` (pass ``device_memory`` for those), or a
            CUDA device that is not visible.
    """
    if device.type == "cpu":
        return cpu_available_bytes()
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = 0 if device.index is None else device.index
        if index >= count:
            raise ValueError(
                f"cannot probe {device}: {count} CUDA device(s) visible; pass device_memory={{...}} to plan "
                "for devices this machine does not have"
            )
        free, _total = torch.cuda.mem_get_info(index)
        logger.debug("probed %s: %d bytes free", device, free)
        return int(free)
    raise ValueError(
        f"cannot probe the memory of a {device.type!r} device; pass device_memory={{{str(device)!r}: bytes}}"
    )
