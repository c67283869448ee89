"""A reference to a value kept by another member of a :class:`~.transport.C10dTransport`.

:meth:`C10dTransport.remote <pc_distributed.rpc._c10d.transport.C10dTransport.remote>` returns one. The owner
keeps the value until the reference is released, explicitly or when it is garbage-collected in its creator;
both send one release frame to the owner (the garbage collector's through the transport's housekeeper, since a
finalizer may run on any thread at any time). It works through :class:`RemoteValues`, the creator's side of
remote values, which the transport that made it implements: waiting for the creation, fetching a copy,
releasing.
"""

from __future__ import annotations

import weakref
from concurrent.futures import TimeoutError as _FutureTimeout
from typing import Any, Protocol

from pc_distributed._checks import optional_timeout
from pc_distributed.rpc._c10d.calls import PendingCall
from pc_distributed.rpc._c10d.frames import VALUE

__all__ = ["C10dRemoteRef", "RemoteValues"]


class RemoteValues(Protocol):
    """The creator's side of remote values: what a :class:`C10dRemoteRef` needs of the transport that made it.

    :class:`~.transport.C10dTransport` implements it. A remote value is named by its owner's rank and the id
    of the remote call that created it; the call itself (a :class:`~.calls.PendingCall`) completes when the
    owner holds the value, or with the creation's error.
    """

    @property
    def rank(self) -> int:
        """This process's rank."""
        ...

    @property
    def names(self) -> tuple[str, ...]:
        """The members' names, by rank."""
        ...

    def member(self, rank: int) -> str:
        """How errors name member ``rank``."""
        ...

    def wait_call(self, call: PendingCall) -> Any:
        """Wait for ``call`` until its deadline (then ``TimeoutError``); its value, or its error raised."""
        ...

    def call_outcome(self, call: PendingCall) -> Any:
        """The value of the completed ``call``, or its error raised."""
        ...

    def fetch_value(self, owner: int, ref_id: int, timeout: float | None) -> Any:
        """A copy of the value ``owner`` keeps for call ``ref_id`` (``timeout``: None, the default)."""
        ...

    def release_value(self, owner: int, ref_id: int) -> None:
        """Tell ``owner`` to drop the value of remote call ``ref_id`` now."""
        ...

    def release_value_later(self, owner: int, ref_id: int) -> None:
        """Like :meth:`release_value`, from another thread (safe in a garbage-collector callback)."""
        ...


def _release_ref(values_ref: weakref.ReferenceType[RemoteValues], owner: int, ref_id: int) -> None:
    """The finalizer of a garbage-collected :class:`C10dRemoteRef` (it may run on any thread, any time)."""
    values = values_ref()
    if values is not None:
        values.release_value_later(owner, ref_id)


class C10dRemoteRef:
    """A reference to a value kept by its owner (from :meth:`~.transport.C10dTransport.remote`).

    The owner keeps the value until :meth:`release` or until this object is garbage-collected, whichever
    comes first; both send one release frame to the owner. Belongs to the process that created it (it cannot
    be pickled).
    """

    def __init__(self, values: RemoteValues, owner: int, ref_id: int, created: PendingCall) -> None:
        self._values = values
        self._owner = owner
        self._ref_id = ref_id
        self._created = created
        self._release = weakref.finalize(self, _release_ref, weakref.ref(values), owner, ref_id)
        self._release.atexit = False

    @property
    def owner_rank(self) -> int:
        """The owner's rank."""
        return self._owner

    def owner(self) -> str:
        """The owner's name."""
        return self._values.names[self._owner]

    def is_owner(self) -> bool:
        """Whether this process keeps the value."""
        return self._owner == self._values.rank

    def confirmed_by_owner(self) -> bool:
        """Whether the owner has created the value (the remote call's reply arrived without an error)."""
        future = self._created.future
        return future.done() and future.exception() is None and future.result(0)[0] == VALUE

    def wait_created(self, timeout: float | None = None) -> None:
        """Wait until the owner holds the value (``timeout``: None or -1 for the remote call's own).

        Raises:
            Exception: The remote exception of the creation (its type, the remote traceback as ``__cause__``).
            TimeoutError: If the creation did not finish in time.
            ConnectionError: If the owner is lost or shut down.
        """
        seconds = optional_timeout("timeout", timeout)
        if seconds is None:
            self._values.wait_call(self._created)
            return
        try:
            self._created.future.result(seconds)
        except _FutureTimeout:
            raise TimeoutError(
                f"remote value on {self._values.member(self._owner)} not created within {seconds:g} s"
            ) from None
        self._values.call_outcome(self._created)

    def to_here(self, timeout: float | None = None) -> Any:
        """A copy of the value, fetched from the owner (``timeout``: seconds, None or -1: the default).

        Raises:
            KeyError: If the value was released.
            Exception: The remote exception of the creation.
            TimeoutError: If the creation or the fetch did not finish in time.
            ConnectionError: If the owner is lost or shut down.
            RuntimeError: If the transport is shut down.
        """
        self.wait_created(timeout)
        if not self._release.alive:
            raise KeyError(f"the remote value on {self._values.member(self._owner)} was released")
        return self._values.fetch_value(self._owner, self._ref_id, timeout)

    def release(self) -> None:
        """Tell the owner to drop the value now (idempotent; later :meth:`to_here` raises ``KeyError``)."""
        if self._release.detach() is not None:
            self._values.release_value(self._owner, self._ref_id)

    def __reduce__(self) -> Any:
        raise TypeError("a C10dRemoteRef belongs to the process that created it and cannot be pickled")

    def __repr__(self) -> str:
        return f"C10dRemoteRef(owner={self.owner()!r}, id={self._ref_id})"
