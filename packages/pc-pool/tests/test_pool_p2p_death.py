"""P2PPool: after a worker dies, the chunks pinned to its index go to the replacement at once."""

from __future__ import annotations

import os
import signal

import pool_testutils as tu
import pytest

import pc_pool
from pc_pool import _feeder


def _kill_on_one(x: int) -> int:
    if x == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return x * 10


def test_p2p_pool_feeds_the_replacement_without_waiting_for_the_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    # The feeders' periodic re-check becomes an hour: only a notification can hand the chunks pinned to the
    # dead worker's index (3 and 5 here, chunk k -> worker k % 2) to its replacement before get() times out.
    monkeypatch.setattr(_feeder, "TICK", 3600.0)
    pool = pc_pool.P2PPool(2, share_method="cpu")
    try:
        result = pool.map_async(_kill_on_one, range(6), chunksize=1)
        with pytest.raises(pc_pool.WorkerDiedError):
            result.get(tu.T)
        assert pool.map(_kill_on_one, [0, 2, 3, 4, 5], chunksize=1) == [0, 20, 30, 40, 50]
    finally:
        pool.terminate()
