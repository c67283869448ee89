"""CUDA paths: the managed model stays on its device; loads keep device and parameter identity."""

from __future__ import annotations

from typing import Any

import pytest
from server_fakegroup import Hub
from server_models import PlainSGD, ThreeLayer, backward_once

from pc_server import PushPullGradServerImpl, PushPullModelServerImpl


def _cuda_grad_server(group: Any, managed: ThreeLayer) -> PushPullGradServerImpl:
    """A started gradient server "g" on ``group`` that applies each push to ``managed`` (on CUDA) at once."""
    impl = PushPullGradServerImpl(
        "g", group, secondary_reducers=["0"], reduce_batch_size=1, flush_timeout=None, reduce_device="cuda"
    )
    impl.manage_model(managed, PlainSGD(managed.parameters()))
    impl.start()
    return impl


@pytest.mark.gpu
def test_grad_server_keeps_cuda_model_on_device(hub3: Hub) -> None:
    managed = ThreeLayer().cuda()
    ids = [id(p) for p in managed.parameters()]
    impl = _cuda_grad_server(hub3.group("0"), managed)
    try:
        client = hub3.group("1").get_paired("g").to_here()
        model = ThreeLayer().cuda()
        backward_once(model)
        client.push(model)
        assert impl.wait_for_version(1, 30)
        impl.watch()
        assert all(p.is_cuda for p in managed.parameters())
        assert [id(p) for p in managed.parameters()] == ids
        assert managed.weights() == (-5.0, -1.0, 1.0)
        assert client.pull(model)  # push pulled before the (asynchronous) update was applied
        assert all(p.is_cuda for p in model.parameters())
        assert model.weights() == (-5.0, -1.0, 1.0)
    finally:
        impl.stop(timeout=30)


@pytest.mark.gpu
def test_model_server_pull_into_cuda_model(hub3: Hub) -> None:
    PushPullModelServerImpl("m", hub3.group("0"))
    client = hub3.group("1").get_paired("m").to_here()
    src = ThreeLayer().cuda()
    assert client.push(src)
    dst = ThreeLayer().cuda()
    dst.pp_version = -1
    param = dst.fc1.weight
    assert client.pull(dst)
    assert dst.fc1.weight is param
    assert param.is_cuda


def _cuda_grad_server_world(rank: int) -> dict[str, object]:
    import pc_distributed as pd

    world = pd.get_world()
    assert world is not None
    group = world.create_rpc_group("g", ["0", "1"])
    impl = None
    if rank == 0:
        managed = ThreeLayer().cuda()
        impl = _cuda_grad_server(group, managed)
    group.barrier(60)
    out: dict[str, object] = {}
    if rank == 1:
        client = group.get_paired("g").to_here()
        model = ThreeLayer().cuda()
        backward_once(model)
        client.push(model)
    group.barrier(60)
    if impl is not None:
        out["applied"] = impl.wait_for_version(1, 30)
        out["server"] = (sorted({p.device.type for p in managed.parameters()}), managed.weights())
    group.barrier(60)
    if rank == 1:
        out["pulled"] = client.pull(model)
        out["client"] = (sorted({p.device.type for p in model.parameters()}), model.weights())
    group.barrier(60)
    if impl is not None:
        impl.stop(timeout=30)
    return out


@pytest.mark.gpu
def test_grad_server_over_c10d_takes_and_gives_cuda_tensors() -> None:
    """A client's CUDA gradients reach a CUDA model served by another process, and its weights come back on
    CUDA (the c10d RPC backend; two ranks sharing one GPU)."""
    import pc_distributed as pd

    server, client = pd.run_world(_cuda_grad_server_world, 2, rpc_backend="c10d", timeout=170)
    assert server["applied"] is True
    assert server["server"] == (["cuda"], (-5.0, -1.0, 1.0))
    assert client["pulled"] is True
    assert client["client"] == (["cuda"], (-5.0, -1.0, 1.0))
