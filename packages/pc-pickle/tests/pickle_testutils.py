"""Helpers for the pc-pickle tests that child processes import by name (spawn needs importable targets)."""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

import torch

import pc_pickle

TIMEOUT = 60.0


def consume(conn: Connection) -> None:
    """Child: load payloads from ``conn`` until None; answer each with a copy payload of a report.

    For each received payload: load it, add 1 in place to every tensor under the key "inplace", and reply with
    ``(summary, loaded)`` where summary describes the tensors (so the parent can compare).
    """
    try:
        while conn.poll(TIMEOUT):
            data = conn.recv_bytes()
            if data == b"stop":
                break
            try:
                obj = pc_pickle.loads(data)
                for t in obj.get("inplace", []) if isinstance(obj, dict) else []:
                    t.add_(1)
                if isinstance(obj, dict) and "resend" in obj:
                    reply: Any = ("ok", _try_resend(obj.pop("resend")))
                else:
                    reply = ("ok", _describe(obj))
            except BaseException as exc:  # report everything to the parent
                reply = ("error", f"{type(exc).__name__}: {exc}")
            conn.send_bytes(pc_pickle.dumps(reply))
    finally:
        conn.close()


def _try_resend(t: torch.Tensor) -> str:
    """Share a tensor this process received; returns the error message ("" if it was sent)."""
    try:
        pc_pickle.dumps(t, copy_tensor=False)
    except pc_pickle.UnpicklableObjectError as exc:
        return str(exc)
    return ""


def _describe(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return {
            "type": type(obj).__name__,
            "dtype": str(obj.dtype),
            "shape": tuple(obj.shape),
            "stride": obj.stride(),
            "offset": obj.storage_offset(),
            "requires_grad": obj.requires_grad,
            "values": obj.detach().clone(),
            "shared": obj.is_shared(),
        }
    if isinstance(obj, dict):
        return {key: _describe(value) for key, value in obj.items() if key != "fn"} | (
            {"fn": obj["fn"](3)} if "fn" in obj else {}
        )
    if isinstance(obj, (list, tuple)):
        return [_describe(item) for item in obj]
    return obj


def produce_and_exit(conn: Connection, strategy: str) -> None:
    """Child: set the sharing strategy (child only), send a share payload of a tensor, then exit."""
    torch.multiprocessing.set_sharing_strategy(strategy)
    conn.send_bytes(pc_pickle.dumps(torch.full((4,), 7.0), copy_tensor=False))
    conn.close()


def produce_many(conn: Connection, strategy: str, count: int) -> None:
    """Child: set the sharing strategy (child only), send ``count`` share payloads of fresh tensors (each
    dropped right after its dump), then wait for the parent's word before exiting."""
    torch.multiprocessing.set_sharing_strategy(strategy)
    for i in range(count):
        conn.send_bytes(pc_pickle.dumps(torch.full((16,), float(i)), copy_tensor=False))
    conn.poll(TIMEOUT)
    conn.close()


def produce_and_release(conn: Connection, strategy: str, count: int) -> None:
    """Child: dump ``count`` share payloads of fresh tensors, never send them, release each, then exit."""
    torch.multiprocessing.set_sharing_strategy(strategy)
    payloads = [pc_pickle.dumps(torch.full((16,), float(i)), copy_tensor=False) for i in range(count)]
    for data in payloads:
        pc_pickle.release(data)
    conn.send_bytes(b"released")
    conn.close()


def _refuse_to_load() -> None:
    raise RuntimeError("the graph was unpickled")


class RefusesToLoad:
    """Pickles fine; unpickling it raises (proves that ``release`` never unpickles the graph)."""

    def __reduce__(self) -> Any:
        return (_refuse_to_load, ())
