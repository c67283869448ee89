"""The ordered server's state: a versioned key-value store with an atomic compare-and-set (pure, no RPC).

Rules (see the pc-server design note):

* a new key is accepted whatever ``prev_version`` is;
* an existing key is accepted iff its *head* (the last accepted version, not the numeric maximum) equals
  ``prev_version``;
* ``version == prev_version`` (== head) overwrites the head in place;
* a version still in the retained history, other than the head, is refused;
* after an accepted push the oldest versions are trimmed until at most ``version_depth`` remain (head
included).

The lock is held for the compare and the insert only; values are stored as given (callers pass private
copies).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any, NamedTuple

from pc_server._checks import positive_int

__all__ = ["PullResult", "PushResult", "VersionedStore", "check_version_depth", "is_newer"]


class PushResult(NamedTuple):
    """Outcome of a compare-and-set push.

    Attributes:
        accepted: Whether the push became the new head.
        head: The key's head version after the push (``None`` only if the key has never been stored).
        newest: ``(value, head)`` when the push was refused and the caller asked for the newest entry, else
            ``None``.
    """

    accepted: bool
    head: Any
    newest: tuple[Any, Any] | None = None


class PullResult(NamedTuple):
    """Outcome of a conditional pull (``pull_if_newer``).

    Attributes:
        fresh: ``True`` if ``value`` holds an entry newer than the version the caller already has.
        value: The newest value when ``fresh``, else ``None`` (nothing was sent).
        version: The key's head version.
    """

    fresh: bool
    value: Any
    version: Any


def check_version_depth(version_depth: object) -> int:
    """Validate ``version_depth``: an int >= 1.

    Args:
        version_depth: The value to check.

    Returns:
        The depth.

    Raises:
        TypeError: If it is not an int.
        ValueError: If it is smaller than 1.
    """
    return positive_int("version_depth", version_depth)


def is_newer(head: Any, known: Any) -> bool:
    """Whether ``head`` is newer than ``known`` (``known < head``; unordered types: ``!=``).

    Args:
        head: The server's head version.
        known: The version the caller holds, or ``None`` for none.

    Returns:
        ``True`` if the caller should load the head.
    """
    if known is None:
        return True
    try:
        return bool(known < head)
    except TypeError:
        return bool(known != head)


def _check_key(key: Any) -> None:
    if not isinstance(key, Hashable):
        raise TypeError(f"key must be hashable, got {type(key).__name__}")


class VersionedStore:
    """A thread-safe versioned key-value store with compare-and-set pushes.

    Args:
        version_depth: How many versions of each key are kept, the head included (1 keeps only the newest).

    Raises:
        TypeError: If ``version_depth`` is not an int.
        ValueError: If ``version_depth`` is smaller than 1.
    """

    def __init__(self, version_depth: int = 1) -> None:
        self._depth = check_version_depth(version_depth)
        self._lock = threading.Lock()
        self._entries: dict[Any, OrderedDict[Any, Any]] = {}

    @property
    def version_depth(self) -> int:
        """How many versions of each key are kept."""
        return self._depth

    def push(
        self, key: Any, value: Any, version: Any, prev_version: Any, *, want_newest: bool = False
    ) -> PushResult:
        """Compare-and-set ``key`` to ``value`` at ``version`` if its head is ``prev_version``.

        Args:
            key: A hashable key.
            value: The value, stored as given (pass a private copy).
            version: The new version (hashable, not ``None``).
            prev_version: The version the caller believes is the head.
            want_newest: On refusal, also return the newest ``(value, version)``.

        Returns:
            The :class:`PushResult`.

        Raises:
            TypeError: If ``key`` or ``version`` is not hashable.
            ValueError: If ``version`` is ``None``.
        """
        _check_key(key)
        if version is None:
            raise ValueError("version must not be None (None means 'the newest' in pull)")
        if not isinstance(version, Hashable):
            raise TypeError(f"version must be hashable, got {type(version).__name__}")
        with self._lock:
            chain = self._entries.get(key)
            if chain is None:
                self._entries[key] = OrderedDict([(version, value)])
                return PushResult(True, version)
            head = next(reversed(chain))
            if prev_version != head or (version != head and version in chain):
                newest = (chain[head], head) if want_newest else None
                return PushResult(False, head, newest)
            if version == head:
                chain[head] = value  # the documented "no order guarantee" overwrite of the head
                return PushResult(True, head)
            chain[version] = value
            while len(chain) > self._depth:
                chain.popitem(last=False)
            return PushResult(True, version)

    def pull(self, key: Any, version: Any = None) -> tuple[Any, Any] | None:
        """Return ``(value, version)`` of the head, or of exactly ``version``; ``None`` if absent.

        The value is the stored object itself: callers copy it (RPC serialisation does) outside the lock.

        Args:
            key: A hashable key.
            version: The wanted version, or ``None`` for the newest.

        Returns:
            ``(value, version)`` or ``None``.

        Raises:
            TypeError: If ``key`` is not hashable.
        """
        _check_key(key)
        with self._lock:
            chain = self._entries.get(key)
            if chain is None:
                return None
            if version is None:
                head = next(reversed(chain))
                return chain[head], head
            try:
                found = version in chain
            except TypeError:  # an unhashable version cannot be stored
                return None
            return (chain[version], version) if found else None

    def pull_if_newer(self, key: Any, known_version: Any) -> PullResult | None:
        """Return the head only if it is newer than ``known_version`` (see :func:`is_newer`).

        Args:
            key: A hashable key.
            known_version: The version the caller holds, or ``None``.

        Returns:
            ``None`` if the key is absent, else a :class:`PullResult` (``value`` is ``None`` when not fresh).
        """
        _check_key(key)
        with self._lock:
            chain = self._entries.get(key)
            if chain is None:
                return None
            head = next(reversed(chain))
            if is_newer(head, known_version):
                return PullResult(True, chain[head], head)
            return PullResult(False, None, head)

    def entries(self) -> dict[Any, list[tuple[Any, Any]]]:
        """Every key's retained ``(version, value)`` pairs, oldest first (the stored values, not copies)."""
        with self._lock:
            return {key: list(chain.items()) for key, chain in self._entries.items()}

    def replace_entries(self, entries: dict[Any, list[tuple[Any, Any]]]) -> None:
        """Replace the whole content at once (values stored as given); longer chains keep their newest.

        Args:
            entries: ``{key: [(version, value), ...]}``, oldest first, as :meth:`entries` returns.

        Raises:
            TypeError: A key or a version is not hashable.
            ValueError: A chain is empty, repeats a version or holds the version ``None``.
        """
        new: dict[Any, OrderedDict[Any, Any]] = {}
        for key, chain in entries.items():
            _check_key(key)
            if not chain:
                raise ValueError(f"key {key!r} has no versions")
            versions = [version for version, _value in chain]
            if any(version is None for version in versions):
                raise ValueError(f"key {key!r} holds the version None")
            if not all(isinstance(version, Hashable) for version in versions):
                raise TypeError(f"key {key!r} holds an unhashable version")
            if len(set(versions)) != len(versions):
                raise ValueError(f"key {key!r} repeats a version: {versions}")
            new[key] = OrderedDict(chain[-self._depth :])
        with self._lock:
            self._entries = new

    def versions(self, key: Any) -> list[Any]:
        """The retained versions of ``key``, oldest first (empty if absent)."""
        _check_key(key)
        with self._lock:
            chain = self._entries.get(key)
            return list(chain) if chain is not None else []
