"""CUDA paths: the managed model stays on its device; loads keep device and parameter identity."""

from __future__ import annotations

import pytest
from server_fakegroup import Hub
from server_models import PlainSGD, ThreeLayer, backward_once

from pc_server import PushPullGradServerImpl, PushPullModelServerImpl


@pytest.mark.gpu
def test_grad_server_keeps_cuda_model_on_device(hub3: Hub) -> None:
    managed = ThreeLayer().cuda()
    ids = [id(p) for p in managed.parameters()]
    impl = PushPullGradServerImpl(
        "g",
        hub3.group("0"),
        secondary_reducers=["0"],
        reduce_batch_size=1,
        flush_timeout=None,
        reduce_device="cuda",
    )
    impl.manage_model(managed, PlainSGD(managed.parameters()))
    impl.start()
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
