"""RemoteRef: a reference to a value on another member whose ``to_here()`` unwraps remote errors.

The backend's remote value (``_backend.RemoteValue``; on TensorPipe torch's RRef, with a bounded
``to_here``) holds an envelope (see ``_remote``); :meth:`RemoteRef.to_here` fetches it and returns the value,
or raises the remote exception with its original type and the remote traceback as ``__cause__``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pc_distributed._checks import optional_timeout
from pc_distributed._torch_errors import peer_error
from pc_distributed.rpc._remote import MissingOnOwner, unwrap

__all__ = ["RemoteRef"]


class RemoteRef:
    """A reference to a value owned by a member (from ``remote``, ``registered_remote``, ``get_paired``).

    It belongs to the process that got it: an argument or result holding one is refused with a
    ``TypeError`` on either backend (the c10d backend's references are not counted across processes).

    Args:
        rref: The backend's remote value holding an envelope (on TensorPipe a
            :class:`~._tensorpipe.TensorPipeValue`: torch's ``RRef`` with a bounded ``to_here``).
        owner_name: Name of the owning member.
        on_missing: Raised (as an exception factory) when the owner no longer holds the key.
    """

    def __init__(self, rref: Any, owner_name: str, on_missing: Callable[[], Exception] | None = None) -> None:
        self.rref = rref
        self._owner_name = owner_name
        self._on_missing = on_missing

    def to_here(self, timeout: float | None = None) -> Any:
        """Fetch a copy of the value (also when called on the owner).

        Args:
            timeout: Seconds (None or -1: the World's ``rpc_timeout``).

        Raises:
            KeyError: If the owner no longer holds the paired value or service.
            TimeoutError: If the value did not arrive in time.
            Exception: The remote exception, original type, remote traceback as ``__cause__``.
        """
        seconds = optional_timeout("timeout", timeout)
        try:
            envelope = self.rref.to_here() if seconds is None else self.rref.to_here(seconds)
        except (RuntimeError, OSError) as exc:
            raise peer_error(exc, self._owner_name, "to_here") from exc
        try:
            return unwrap(envelope, f"process {self._owner_name!r}", copy_value=self.rref.is_owner())
        except MissingOnOwner:
            if self._on_missing is None:  # pragma: no cover - every creator passes one
                raise KeyError(f"value not found on {self._owner_name!r}") from None
            raise self._on_missing() from None

    def owner(self) -> Any:
        """The backend's description of the owner (the ``WorkerInfo`` on TensorPipe)."""
        return self.rref.owner()

    def owner_name(self) -> str:
        """The member name of the owner."""
        return self._owner_name

    def is_owner(self) -> bool:
        """Whether this process owns the value."""
        return bool(self.rref.is_owner())

    def confirmed_by_owner(self) -> bool:
        """Whether the owner has confirmed the reference."""
        return bool(self.rref.confirmed_by_owner())

    def __reduce__(self) -> Any:
        raise TypeError(
            f"a RemoteRef (of a value on {self._owner_name!r}) belongs to the process that got it and "
            "cannot be sent to another: send its value (to_here()), or let the other member get its own "
            "reference (pair the value and call get_paired there)"
        )

    def __repr__(self) -> str:
        return f"RemoteRef(owner={self._owner_name!r})"
