"""A registered service's asynchronous call on stand-ins: the retry on a stale owner and the errors' names.

``ServiceCall.future`` chains the owner's answer through ``chain_future`` and, when the owner no longer holds
the service (a stale directory entry), asks the directory afresh once; these tests replace the RPC send and
the directory, so the retry and the error texts are checked without a World.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pc_distributed.rpc._calls import ServiceCall
from pc_distributed.rpc._remote import MISSING, OK


class _Directory:
    """Answers ``stale`` from the cache and ``fresh`` on a refresh; records the look-ups."""

    def __init__(self, stale: str | None, fresh: str | None) -> None:
        self.stale, self.fresh = stale, fresh
        self.asked: list[bool] = []

    def owner(self, kind: str, key: str, refresh: bool) -> str | None:
        self.asked.append(refresh)
        return self.fresh if refresh else self.stale


def _call(directory: _Directory, answers: dict[str, Any]) -> tuple[ServiceCall, list[str]]:
    """A ServiceCall whose send to owner X completes with ``answers[X]`` (an envelope or an exception)."""
    call = ServiceCall(None, directory, "g", "svc", (1,), {}, 5.0)  # type: ignore[arg-type]
    sent: list[str] = []

    def send(how: str, owner: str) -> torch.futures.Future[Any]:
        sent.append(f"{how}:{owner}")
        fut: torch.futures.Future[Any] = torch.futures.Future()
        answer = answers[owner]
        if isinstance(answer, BaseException):
            fut.set_exception(answer)
        else:
            fut.set_result(answer)
        return fut

    call._send = send  # type: ignore[method-assign]
    return call, sent


def test_a_stale_owner_is_asked_again_once_and_the_fresh_owner_answers() -> None:
    directory = _Directory("a", "b")
    call, sent = _call(directory, {"a": (MISSING,), "b": (OK, 42)})
    assert call.future().wait() == 42
    assert sent == ["rpc_async:a", "rpc_async:b"]
    assert directory.asked == [False, True]


def test_missing_on_both_owners_is_a_key_error() -> None:
    call, sent = _call(_Directory("a", "b"), {"a": (MISSING,), "b": (MISSING,)})
    with pytest.raises(KeyError, match=r"Service with key \[svc\] not found on Group \[g\]"):
        call.future().wait()
    assert sent == ["rpc_async:a", "rpc_async:b"]


def test_no_owner_after_the_refresh_is_a_key_error() -> None:
    call, sent = _call(_Directory("a", None), {"a": (MISSING,)})
    with pytest.raises(KeyError, match="not found"):
        call.future().wait()
    assert sent == ["rpc_async:a"]


def test_a_lost_owner_is_a_connection_error_naming_it_and_not_retried() -> None:
    call, sent = _call(_Directory("a", "b"), {"a": RuntimeError("Connection reset by peer")})
    with pytest.raises(ConnectionError, match="rpc to 'a' failed") as info:
        call.future().wait()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert sent == ["rpc_async:a"]


def test_a_send_failing_otherwise_completes_the_future_with_its_error() -> None:
    """Not a transport failure (neither RuntimeError nor OSError): passed on as it is, never left pending."""
    call, _ = _call(_Directory("a", "b"), {"a": (OK, None)})
    assert call.future().wait() is None
    failing, _ = _call(_Directory("a", "b"), {"a": ValueError("boom")})
    with pytest.raises(ValueError, match="boom"):
        failing.future().wait()
