"""The issue-14 report with the reducer processes parked in ``group.barrier()`` (a world function)."""

from __future__ import annotations

from typing import Any

import torch
from server_grid import REGRESSION, WAIT_S, regression_client

from pc_server import PushPullGradServerImpl

__all__ = ["barrier_world"]


def barrier_world(rank: int) -> dict[str, Any]:
    """The issue-14 report as users write it: reducers '0', '1' wait in ``group.barrier()`` while '2' pushes.

    Before pc-distributed's issue 22 was fixed, the waiting main thread held the process's store client, so
    secondary '1' could not look up the primary and forwarded nothing until the barrier released.
    """
    torch.set_num_threads(1)
    from server_models import PlainSGD, ThreeLayer

    from pc_distributed import get_world

    world = get_world()
    assert world is not None
    me = str(rank)
    group = world.create_rpc_group("parked", ["0", "1", "2"])
    impl = None
    model = None
    if me in REGRESSION.reducers:
        impl = PushPullGradServerImpl(REGRESSION.name, group, **REGRESSION.server_kwargs())
        if me == REGRESSION.primary:
            model = ThreeLayer()
            impl.manage_model(model, PlainSGD(model.parameters()))
        impl.start()
    group.barrier(WAIT_S)  # every reducer is paired
    out: dict[str, Any] = {}
    if me in REGRESSION.clients:
        out["regression"] = regression_client(group)
    group.barrier(WAIT_S)  # reducers park here while the client pushes and polls
    if impl is not None:
        impl.stop(timeout=WAIT_S)  # all at once: the primary waits for the other secondary to drain
        impl.watch()
        out["ledger"] = impl.ledger()
        if model is not None:
            out["final"] = model.weights()
    group.barrier(WAIT_S)
    return out
