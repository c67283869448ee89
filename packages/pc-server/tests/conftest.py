"""Fixtures of the pc-server tests."""

from __future__ import annotations

import pytest
from server_fakegroup import Hub


@pytest.fixture
def hub3() -> Hub:
    """A fake three-process RpcGroup hub with members "0", "1", "2"."""
    return Hub(["0", "1", "2"])
