"""patch_replication_callback: type checks, idempotence, customized subclasses, pickling."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn

from pc_replicate import CallbackContext, ReplicationCallbackDataParallel, patch_replication_callback


class Recorder(nn.Linear):
    """A module-level (picklable) module whose callback counts its calls on the context."""

    def __init__(self) -> None:
        super().__init__(2, 2)

    def __data_parallel_replicate__(self, ctx: CallbackContext, copy_id: int) -> None:
        ctx.calls = [*getattr(ctx, "calls", []), copy_id]
        self.ctx = ctx


class CustomDataParallel(nn.DataParallel[Any]):
    """A customized DataParallel (module level, so it pickles): replicates by deep copy, anywhere."""

    extra = "custom"

    def replicate(self, module: Any, device_ids: Sequence[int | torch.device]) -> list[Any]:
        return [copy.deepcopy(module) for _ in device_ids]


def _calls(replicas: list[nn.Module]) -> list[int]:
    return list(replicas[0].ctx.calls)


def test_rejects_non_data_parallel() -> None:
    with pytest.raises(TypeError, match=r"expects a torch\.nn\.DataParallel, got Linear"):
        patch_replication_callback(nn.Linear(2, 2))  # type: ignore[type-var]
    with pytest.raises(TypeError, match="got str"):
        patch_replication_callback("dp")  # type: ignore[type-var]


def test_plain_data_parallel_becomes_rcdp_and_patching_twice_runs_callbacks_once() -> None:
    dp = nn.DataParallel(Recorder())
    patched = patch_replication_callback(dp)
    assert patched is dp
    assert type(dp) is ReplicationCallbackDataParallel
    assert isinstance(dp, nn.DataParallel)
    assert patch_replication_callback(dp) is dp
    assert type(dp) is ReplicationCallbackDataParallel
    assert _calls(dp.replicate(dp.module, ["cpu"] * 3)) == [0, 1, 2]
    assert "replicate" not in vars(dp)  # no instance attribute, no closure


def test_customized_subclass_keeps_its_replicate_and_gains_callbacks() -> None:
    dp = CustomDataParallel(Recorder())
    patch_replication_callback(dp)
    cls = type(dp)
    assert isinstance(dp, CustomDataParallel)
    assert dp.extra == "custom"
    assert patch_replication_callback(dp) is dp
    assert type(dp) is cls
    assert type(patch_replication_callback(CustomDataParallel(Recorder()))) is cls  # the class is cached
    assert _calls(dp.replicate(dp.module, [0, 1])) == [0, 1]


@pytest.mark.parametrize("make", [nn.DataParallel, CustomDataParallel, ReplicationCallbackDataParallel])
def test_patched_objects_survive_pickle_torch_save_and_deepcopy(make: type[nn.DataParallel[Any]]) -> None:
    dp = patch_replication_callback(make(Recorder()))
    cls = type(dp)
    dp.module.weight.data.fill_(0.5)
    buffer = io.BytesIO()
    torch.save(dp, buffer)
    buffer.seek(0)
    copies = [
        pickle.loads(pickle.dumps(dp)),
        torch.load(buffer, weights_only=False),
        copy.deepcopy(dp),
    ]
    for clone in copies:
        assert type(clone) is cls
        assert clone is not dp
        assert clone.module is not dp.module
        assert torch.equal(clone.module.weight, dp.module.weight)
        replicas = clone.replicate(clone.module, [0, 1] if make is CustomDataParallel else ["cpu"] * 2)
        assert _calls(replicas) == [0, 1]
        assert all(r is not dp.module for r in replicas)
