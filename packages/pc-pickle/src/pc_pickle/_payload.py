"""The outer payload: ``_load_payload(format_version, table, graph_bytes)``, an ordinary protocol-5 pickle.

The top-level call is this importable module's function, so plain :func:`pickle.loads` reads a payload too. (A
rebuild function defined in ``__main__`` would be pickled by value and lose its globals in a spawned process.)
"""

from __future__ import annotations

import pickle
from typing import Any

from pc_pickle._errors import PayloadError
from pc_pickle._tensors import installed_storages, materialize_entry

__all__ = ["FORMAT_VERSION", "MAGIC", "Payload"]

FORMAT_VERSION = 1
# Every payload names this module near its start; loads() checks for it before unpickling foreign bytes.
MAGIC = __name__.encode()


class Payload:
    """One dump's outer object: the materialized storage table and the pickled graph.

    Args:
        table: The storage table entries (phase 2).
        graph: The pickled object graph (phase 1).
    """

    __slots__ = ("graph", "table")

    def __init__(self, table: list[tuple[Any, ...]], graph: bytes) -> None:
        self.table = table
        self.graph = graph

    def __reduce__(self) -> tuple[Any, ...]:
        return (_load_payload, (FORMAT_VERSION, self.table, self.graph))


def _load_payload(version: int, table: list[tuple[Any, ...]], graph: bytes) -> Any:
    if version != FORMAT_VERSION:
        raise PayloadError(
            f"payload format version {version!r} cannot be read by this pc_pickle, which reads version "
            f"{FORMAT_VERSION}; dump and load with the same pc_pickle version"
        )
    if not isinstance(table, list) or not isinstance(graph, (bytes, bytearray)):
        raise PayloadError(
            "malformed payload: expected a list and bytes, got "
            f"{type(table).__name__} and {type(graph).__name__}"
        )
    storages = [materialize_entry(entry) for entry in table]
    with installed_storages(storages):
        return pickle.loads(graph)
