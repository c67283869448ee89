"""Which network interface gloo and TensorPipe use: ``GLOO_SOCKET_IFNAME`` and ``TP_SOCKET_IFNAME``.

torch reads both from the environment when it creates a process group (``init_process_group``, every
``new_group``) and when RPC starts. Without them each guesses from the host name, which on many Linux installs
resolves to ``127.0.1.1`` or to an outside interface. A :class:`~pc_distributed.World` therefore sets them for
its lifetime: to the ``interface`` it was given, else (a world whose rendezvous address is on loopback) to the
loopback interface, so that a one-host world listens on loopback only. Variables the user set are left alone
unless ``interface`` is given; the previous values come back when the World stops.
"""

from __future__ import annotations

import os
import socket

__all__ = ["IFNAME_VARIABLES", "InterfaceEnv", "check_interface", "loopback_interface"]

IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


def _interfaces() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def check_interface(interface: object) -> str:
    """Validate an interface name against this host's interfaces.

    Raises:
        TypeError: If it is not a str.
        ValueError: If this host has no interface of that name (the message lists those it has).
    """
    if not isinstance(interface, str) or not interface:
        raise TypeError(f"interface must be a non-empty str (e.g. 'eth0'), got {interface!r}")
    names = _interfaces()
    if interface not in names:
        raise ValueError(f"no network interface named {interface!r} on this host; it has {names}")
    return interface


def loopback_interface() -> str | None:
    """The name of the loopback interface (``lo`` on Linux, ``lo0`` on BSD/macOS), or None."""
    names = _interfaces()
    return next((n for n in ("lo", "lo0") if n in names), None)


class InterfaceEnv:
    """Sets the interface variables for a World's lifetime and restores them afterwards.

    Args:
        interface: The interface to use, or None.
        loopback: True when the world meets on a loopback address (then the default is loopback).
    """

    def __init__(self, interface: str | None, loopback: bool) -> None:
        self._saved: dict[str, str | None] = {}
        choice = interface if interface is not None else (loopback_interface() if loopback else None)
        if choice is None:
            return
        for key in IFNAME_VARIABLES:
            if interface is None and key in os.environ:
                continue  # the user's own setting wins over our loopback default
            self._saved[key] = os.environ.get(key)
            os.environ[key] = choice

    def restore(self) -> None:
        """Put back the values from before (idempotent)."""
        saved, self._saved = self._saved, {}
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
