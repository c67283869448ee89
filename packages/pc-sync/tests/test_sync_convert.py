"""convert_model: which modules it swaps, what it keeps, and DataParallel wrapping."""

from __future__ import annotations

import sys

import pytest
import torch
from sync_testutils import assert_close
from torch import nn

from pc_replicate import ReplicationCallbackDataParallel
from pc_sync import (
    SynchronizedBatchNorm1d,
    SynchronizedBatchNorm2d,
    SynchronizedBatchNorm3d,
    convert_model,
)
from pc_sync.replica_batchnorm import _TORCH_BN_TAKES_BIAS


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.block = nn.Sequential(nn.BatchNorm2d(4), nn.ReLU())
        self.head = nn.ModuleDict(
            {"bn1": nn.BatchNorm1d(4, momentum=None), "bn3": nn.BatchNorm3d(2, eps=1e-3)}
        )


def test_nested_and_top_level_modules_are_converted_in_place() -> None:
    net = _Net()
    conv, relu = net.conv, net.block[1]
    out = convert_model(net)
    assert out is net
    assert type(net.block[0]) is SynchronizedBatchNorm2d
    assert type(net.head["bn1"]) is SynchronizedBatchNorm1d
    assert type(net.head["bn3"]) is SynchronizedBatchNorm3d
    assert net.conv is conv
    assert net.block[1] is relu
    top = nn.BatchNorm3d(5)
    assert type(convert_model(top)) is SynchronizedBatchNorm3d


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"momentum": None},
        {"eps": 1e-2, "momentum": 0.3},
        {"affine": False},
        {"bias": False},
        {"track_running_stats": False},
        {"dtype": torch.float64},
    ],
    ids=str,
)
@pytest.mark.parametrize("training", [True, False])
def test_state_and_hyper_parameters_are_kept(kwargs: dict[str, object], training: bool) -> None:
    if "bias" in kwargs and not _TORCH_BN_TAKES_BIAS:
        pytest.skip("this torch's BatchNorm has no bias argument (test_sync_behaviour covers the emulation)")
    bn = nn.BatchNorm2d(4, **kwargs)  # type: ignore[arg-type]
    bn.train()
    bn(torch.randn(5, 4, 2, 2, dtype=bn.running_mean.dtype if bn.running_mean is not None else torch.float32))
    bn.train(training)
    params = dict(bn.named_parameters())
    buffers = dict(bn.named_buffers())
    new = convert_model(bn)
    assert type(new) is SynchronizedBatchNorm2d
    for attr in ("num_features", "eps", "momentum", "affine", "track_running_stats", "training"):
        assert getattr(new, attr) == getattr(bn, attr), attr
    assert (new.weight is None, new.bias is None) == (bn.weight is None, bn.bias is None)
    assert dict(new.named_parameters()).keys() == params.keys()
    assert all(new.get_parameter(k) is v for k, v in params.items())  # the same objects
    assert dict(new.named_buffers()).keys() == buffers.keys()
    assert all(new.get_buffer(k) is v for k, v in buffers.items())
    if bn.num_batches_tracked is not None:
        assert int(new.num_batches_tracked) == 1
    assert new.state_dict().keys() == bn.state_dict().keys()
    x = torch.randn(3, 4, 2, 2, dtype=next(iter(params.values())).dtype if params else torch.float32)
    new.eval()
    bn.eval()
    assert_close(new(x), bn(x), rtol=1e-6, atol=1e-6)


def test_existing_optimizer_keeps_working_on_the_converted_parameters() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    held = list(net.parameters())  # what an optimizer built before the conversion holds
    convert_model(net)
    assert all(a is b for a, b in zip(held, net.parameters(), strict=True))
    net(torch.randn(6, 3)).pow(2).sum().backward()
    assert all(p.grad is not None for p in held)  # the optimizer's step would see these gradients


def test_skips_synchronized_torch_sync_and_subclasses_and_rejects_lazy() -> None:
    class MyBN(nn.BatchNorm2d):
        pass

    mine, torch_sync, ours = MyBN(3), nn.SyncBatchNorm(3), SynchronizedBatchNorm2d(3)
    net = nn.Sequential(mine, torch_sync, ours)
    convert_model(net)
    assert net[0] is mine
    assert net[1] is torch_sync
    assert net[2] is ours
    with pytest.raises(ValueError, match="uninitialized LazyBatchNorm2d"):
        convert_model(nn.Sequential(nn.LazyBatchNorm2d()))
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        convert_model("not a module")  # type: ignore[arg-type]


def test_data_parallel_becomes_the_callback_class() -> None:
    dp = nn.DataParallel(nn.Sequential(nn.BatchNorm1d(3)))
    # CPU-only torch leaves device_ids empty and sets no output_device/dim; give it CPU replicas by hand
    dp.device_ids, dp.output_device, dp.dim = ["cpu", "cpu"], "cpu", 0
    dp.module.cpu()  # with one visible GPU, DataParallel moved the module there
    out = convert_model(dp)
    assert isinstance(out, ReplicationCallbackDataParallel)
    assert type(out.module[0]) is SynchronizedBatchNorm1d
    assert out.dim == 0
    assert len(out.device_ids) == 2
    x = torch.randn(6, 3)
    assert_close(out(x), nn.functional.batch_norm(x, None, None, training=True), rtol=1e-5, atol=1e-5)
    # an instance of the callback class is kept, with its module converted
    again = ReplicationCallbackDataParallel(nn.Sequential(nn.BatchNorm1d(3)), device_ids=["cpu"] * 2)
    assert convert_model(again) is again
    assert type(again.module[0]) is SynchronizedBatchNorm1d


def test_data_parallel_without_pc_replicate_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pc_replicate", None)  # makes `import pc_replicate` fail
    with pytest.raises(ImportError, match="pip install pc-replicate"):
        convert_model(nn.DataParallel(nn.BatchNorm1d(3)))
    # plain models never need it
    assert type(convert_model(nn.BatchNorm1d(3))) is SynchronizedBatchNorm1d
