"""Issue 14 part 3: the chaos soak. Clients SIGKILLed mid-push and restarted; nothing lost or applied twice.

The duration is ``PC_SERVER_SOAK_SECONDS`` (default 8 s of chaos; world start and teardown add the rest);
``nox -s soak -- --duration 600`` runs it longer. ``PC_SERVER_SOAK_SEED`` picks the kill moments.
"""

from __future__ import annotations

import os

import pytest
from server_soak import SLOTS, outcome, soak_world

pc_distributed = pytest.importorskip("pc_distributed")

SECONDS = float(os.environ.get("PC_SERVER_SOAK_SECONDS", "8"))
SEED = int(os.environ.get("PC_SERVER_SOAK_SEED", "14"))
RSS_GROWTH = 300 * 2**20  # generous: a leak per push or per client identity would exceed it in a long soak
THREAD_GROWTH = 24


def test_chaos_soak_kills_clients_mid_push_and_the_ledger_balances() -> None:
    results = pc_distributed.run_world(
        soak_world, 3, args=(SECONDS, SEED), timeout=SECONDS + 150, rpc_timeout=20, dist_timeout=30
    )
    seen = outcome(results)
    print(f"soak: {seen.kills} kills, {len(seen.book)} client identities, ledger {seen.ledger.total}")
    # the chaos happened: clients were killed and restarted under new identities
    assert seen.kills >= 2, seen.kills
    assert len(seen.book) >= SLOTS + 1
    # every push a client saw accepted is applied exactly once; nothing else was applied
    ledger = seen.ledger
    assert ledger.balanced(), ledger.total
    assert ledger.total.dropped == 0, ledger.total
    for client, mine in seen.book.items():
        counts = ledger.clients.get(client)
        accepted = counts.accepted if counts is not None else 0
        assert accepted == mine["accepted"], (client, counts, mine)
        assert counts is None or counts.applied == mine["accepted"]
    expected = [-sum(col) for col in zip(*(m["sum"] for m in seen.book.values()), strict=True)]
    assert seen.weights == expected
    assert ledger.total.applied == sum(m["accepted"] for m in seen.book.values()) > 0
    # the reducers' memory and threads stayed bounded
    for rank, ((rss0, threads0), (rss1, threads1)) in seen.usage.items():
        assert rss1 - rss0 < RSS_GROWTH, (rank, rss0, rss1)
        assert threads1 - threads0 <= THREAD_GROWTH, (rank, threads0, threads1)
