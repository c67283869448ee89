"""A reply that matches no task the worker holds breaks the pool; callers wake with that error (issue 16)."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import re

import pool_testutils as tu
import pytest

import pc_pool
from pc_pool import PoolTerminatedError


class _MisreplyingPool(pc_pool.BasePool):
    worker = staticmethod(tu.misreplying_worker)


def test_pool_mismatched_reply_breaks_the_pool_and_wakes_every_caller() -> None:
    # Before: the reply was logged and dropped, so get() and map() waited until their timeout (forever
    # without one). Now every pending call fails with PoolTerminatedError naming the bad reply.
    gate_r, gate_w = os.pipe()  # the workers send their bad replies once the test writes to the gate
    pool = _MisreplyingPool(2, initargs=(gate_r,), context=multiprocessing.get_context("fork"))
    executor = concurrent.futures.ThreadPoolExecutor(1)
    try:
        blocked_map = executor.submit(pool.map_async(tu.ident, range(8)).get)  # get() without a timeout
        it = pool.imap(tu.ident, range(3))
        result = pool.apply_async(tu.ident, (1,))
        os.write(gate_w, b"x" * 64)
        with pytest.raises(PoolTerminatedError, match="matches no pending task") as info:
            result.get(tu.T)
        cause = info.value.__cause__
        assert isinstance(cause, RuntimeError)
        assert re.search(
            r"sent a reply for job \d+ chunk 10\d\d, but the task it was running is job", str(cause)
        )
        with pytest.raises(PoolTerminatedError, match="matches no pending task"):
            blocked_map.result(tu.T)
        with pytest.raises(PoolTerminatedError, match="matches no pending task"):
            it.next(timeout=tu.T)
        with pytest.raises(ValueError, match="Pool not running: it broke"):
            pool.apply_async(tu.ident, (2,))
        pool.join(tu.T)
    finally:
        pool.terminate()
        executor.shutdown(wait=True)
        os.close(gate_r)
        os.close(gate_w)
