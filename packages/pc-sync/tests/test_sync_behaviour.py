"""Synchronized batch norm under CPU thread replicas: protocol corner cases, failures, state, pickling."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from sync_testutils import assert_close, bn_pair, replicated, tolerances
from torch import nn

import pc_sync
from pc_replicate import ReplicationCallbackDataParallel
from pc_sync import SynchronizedBatchNorm1d, SynchronizedBatchNorm2d, SyncTimeoutError

F64 = tolerances(torch.float64)


class _Twice(nn.Module):
    """Calls the same batch norm twice per forward."""

    def __init__(self, bn: nn.Module) -> None:
        super().__init__()
        self.bn = bn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.bn(x) * 1.5 + 0.25)


def test_module_called_twice_on_four_replicas() -> None:
    ref, ours = bn_pair(nn.BatchNorm2d, 3, torch.float64)
    ref_net, dp = _Twice(ref), replicated(_Twice(ours), 4)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        x = torch.randn(8, 3, 2, 2, generator=gen, dtype=torch.float64)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = ref_net(xa), dp(xb)
        assert_close(yb, ya, **F64)
        g = torch.randn(ya.shape, generator=gen, dtype=torch.float64)
        (ya * g).sum().backward()
        (yb * g).sum().backward()
        assert_close(xb.grad, xa.grad, **F64)
    assert_close(ours.weight.grad, ref.weight.grad, **F64)
    assert_close(ours.running_var, ref.running_var, **F64)
    assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked) == 10


def test_fewer_replicas_after_more_does_not_hang() -> None:
    """Rows 8, 1, 8 on 4 replicas (1 row runs on one replica), then train(4) -> eval(4) -> train(2)."""
    ref, ours = bn_pair(nn.BatchNorm2d, 3, torch.float64)
    dp = replicated(ours, 4)
    gen = torch.Generator().manual_seed(1)
    for rows, training in [(8, True), (1, True), (8, True), (8, False), (2, True), (8, True)]:
        ref.train(training)
        dp.train(training)
        x = torch.randn(rows, 3, 2, 2, generator=gen, dtype=torch.float64)
        assert_close(dp(x), ref(x), **F64)
        assert_close(ours.running_mean, ref.running_mean, **F64)
    assert int(ours.num_batches_tracked) == 5


def test_eval_does_not_synchronize() -> None:
    """In eval, replicas that call the module unequally often must not wait for each other."""
    bn = SynchronizedBatchNorm1d(2, sync_timeout=0.5)
    dp = replicated(_ReplicaDependent(bn), 4).eval()
    y = dp(_marked_batch(8, 2))
    assert y.shape == (8, 2)


def test_training_under_no_grad_and_inference_mode() -> None:
    ref, ours = bn_pair(nn.BatchNorm1d, 4, torch.float64)
    dp = replicated(ours, 3)
    x = torch.randn(9, 4, dtype=torch.float64)
    with torch.no_grad():
        y = dp(x)
        assert y.grad_fn is None
        assert_close(y, ref(x), **F64)
    with torch.inference_mode():
        y = dp(x)
        assert y.is_inference()
        assert_close(y, ref(x), **F64)
    assert_close(ours.running_var, ref.running_var, **F64)
    assert int(ours.num_batches_tracked) == 2


def test_two_sync_modules_in_one_model_via_convert_model() -> None:
    torch.manual_seed(2)
    ref = nn.Sequential(
        nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 5), nn.BatchNorm1d(5)
    ).double()
    net = pc_sync.convert_model(copy.deepcopy(ref))
    assert [type(m) for m in net if isinstance(m, nn.BatchNorm1d)] == [SynchronizedBatchNorm1d] * 2
    dp = replicated(net, 4)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        x = torch.randn(10, 6, generator=gen, dtype=torch.float64)
        ya, yb = ref(x), dp(x)
        assert_close(yb, ya, **F64)
        g = torch.randn(ya.shape, generator=gen, dtype=torch.float64)
        (ya * g).sum().backward()
        (yb * g).sum().backward()
    for (name, pa), (_, pb) in zip(ref.named_parameters(), net.named_parameters(), strict=True):
        assert_close(pb.grad, pa.grad, **F64, msg=name)
    for (name, ba), (_, bb) in zip(ref.named_buffers(), net.named_buffers(), strict=True):
        assert_close(bb, ba, **F64, msg=name)


# ------------------------------------------------------------------------------------------ bad input


def test_wrong_rank_raises_torchs_value_error() -> None:
    dp = replicated(SynchronizedBatchNorm2d(3), 2)
    with pytest.raises(ValueError, match="expected 4D input"):
        dp(torch.randn(4, 3, 2))
    with pytest.raises(ValueError, match="expected 4D input"):
        SynchronizedBatchNorm2d(3)(torch.randn(4, 3, 2))


def test_channel_mismatch_raises_runtime_error() -> None:
    dp = replicated(SynchronizedBatchNorm2d(3), 2)
    with pytest.raises(RuntimeError, match="expected input with 3 channels"):
        dp(torch.randn(4, 5, 2, 2))
    with pytest.raises(RuntimeError):  # torch's own error outside replication
        SynchronizedBatchNorm2d(3)(torch.randn(4, 5, 2, 2))


def test_single_value_per_channel_raises_value_error() -> None:
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        replicated(SynchronizedBatchNorm1d(3), 2)(torch.randn(1, 3))
    # a 1-row replica is fine when the whole batch has more values
    y = replicated(SynchronizedBatchNorm1d(3), 4)(torch.randn(3, 3))
    assert y.shape == (3, 3)


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="timeout"):
        SynchronizedBatchNorm2d(3, sync_timeout=0)
    with pytest.raises(TypeError, match="timeout"):
        SynchronizedBatchNorm2d(3, sync_timeout="1")  # type: ignore[arg-type]
    bn = SynchronizedBatchNorm2d(3, sync_timeout=7, bias=False, dtype=torch.float64)
    assert bn.sync_timeout == 7.0
    assert bn.bias is None
    assert bn.weight.dtype == torch.float64


@pytest.mark.parametrize("torch_takes_bias", [True, False], ids=["torch-bias-arg", "older-torch"])
def test_bias_switch_on_every_torch(monkeypatch: pytest.MonkeyPatch, torch_takes_bias: bool) -> None:
    """``bias=False`` and ``convert_model`` work whether torch's _BatchNorm takes ``bias`` or not (2.11)."""
    import pc_sync.replica_batchnorm as bn_module

    if torch_takes_bias and not bn_module._TORCH_BN_TAKES_BIAS:
        pytest.skip("this torch's _BatchNorm has no bias argument")
    monkeypatch.setattr(bn_module, "_TORCH_BN_TAKES_BIAS", torch_takes_bias)
    no_bias = SynchronizedBatchNorm1d(3, bias=False)
    assert no_bias.bias is None
    assert [name for name, _ in no_bias.named_parameters()] == ["weight"]
    with_bias = SynchronizedBatchNorm1d(3)
    assert with_bias.bias is not None
    assert with_bias.bias.shape == (3,)
    ref = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    converted = pc_sync.convert_model(copy.deepcopy(ref))
    assert isinstance(converted[1], SynchronizedBatchNorm1d)
    x = torch.randn(8, 3)
    plain = nn.BatchNorm1d(3)  # its bias starts at zero, so it matches both
    for ours in (no_bias, with_bias):
        assert_close(replicated(ours, 2)(x), plain(x), **tolerances(torch.float32))
    x = torch.randn(8, 4)
    assert_close(replicated(converted, 2)(x), ref(x), **tolerances(torch.float32))


# ------------------------------------------------------------------------------------------- failures


# What each replica's norm raised, by exception type name (the replicas are copies: a shared list).
_SEEN: list[str] = []


def _norm(bn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    try:
        return bn(x)  # type: ignore[no-any-return]
    except Exception as exc:
        _SEEN.append(type(exc).__name__)
        raise


class _ReplicaDependent(nn.Module):
    """Replica 0 (whose chunk starts with a row marked 100) raises or calls its norm twice."""

    def __init__(self, bn: nn.Module, mode: str = "twice") -> None:
        super().__init__()
        self.bn = bn
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        marked = bool(x[0, 0] == 100)
        if marked and self.mode == "raise":
            raise KeyError("replica 0 failed before its norm")
        y = _norm(self.bn, x)
        if marked and self.mode == "twice":
            y = self.bn(y)
        return y


def _marked_batch(rows: int, channels: int) -> torch.Tensor:
    x = torch.randn(rows, channels)
    x[0, 0] = 100.0
    return x


def test_replica_error_surfaces_with_original_type_and_aborts_the_peers() -> None:
    _SEEN.clear()
    bn = SynchronizedBatchNorm1d(2, sync_timeout=60.0)
    dp = replicated(_ReplicaDependent(bn, mode="raise"), 4)
    with pytest.raises(KeyError, match="replica 0 failed"):
        dp(_marked_batch(8, 2))
    # The three peers waiting in the norm left with SyncAbortedError (the abort), not SyncTimeoutError (the
    # 60 s sync timeout).
    assert _SEEN == ["SyncAbortedError"] * 3
    # the module still works afterwards: every replication gets a fresh master
    y = replicated(bn, 4)(torch.randn(8, 2))
    assert y.shape == (8, 2)


def test_slave_error_releases_the_master() -> None:
    class FailLast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = SynchronizedBatchNorm1d(2, sync_timeout=60.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] == 1:
                raise ArithmeticError("last replica failed")
            return _norm(self.bn, x)

    _SEEN.clear()
    with pytest.raises(ArithmeticError):
        replicated(FailLast(), 4)(torch.randn(7, 2))  # chunks 2,2,2,1
    assert _SEEN == ["SyncAbortedError"] * 3  # the master and both other slaves: aborted, not timed out


def test_unequal_call_counts_time_out_naming_the_replicas() -> None:
    bn = SynchronizedBatchNorm1d(2, sync_timeout=0.5)
    dp = replicated(_ReplicaDependent(bn, mode="twice"), 4)
    with pytest.raises(SyncTimeoutError) as info:
        dp(_marked_batch(8, 2))
    assert info.value.missing == (1, 2, 3)
    assert "equally often" in str(info.value)


# --------------------------------------------------------------------------------- state and pickling


def test_state_dict_round_trips_with_torch_batch_norm() -> None:
    ref, ours = bn_pair(nn.BatchNorm2d, 3, torch.float32)
    assert list(ours.state_dict()) == list(ref.state_dict())
    back = nn.BatchNorm2d(3)
    back.load_state_dict(ours.state_dict())
    for key, value in ref.state_dict().items():
        assert torch.equal(back.state_dict()[key], value)


def test_plain_module_and_replicas_pickle_and_deepcopy() -> None:
    _, ours = bn_pair(nn.BatchNorm2d, 3, torch.float32)
    dp = ReplicationCallbackDataParallel(ours, device_ids=["cpu"] * 3)
    replicas = dp.replicate(ours, dp.device_ids)
    x = torch.randn(4, 3, 2, 2)
    ours.eval()
    expected = ours(x)
    for obj in (ours, *replicas, dp):
        for clone in (copy.deepcopy(obj), pickle.loads(pickle.dumps(obj))):
            clone.eval()
            assert_close(clone(x), expected, rtol=1e-6, atol=1e-6)
            for m in clone.modules():
                if isinstance(m, SynchronizedBatchNorm2d):
                    assert m._sync_master is None
                    assert m._slave_pipe is None
    # a deep-copied training model still synchronizes on its own
    twin = copy.deepcopy(ours).train()
    y = replicated(twin, 2)(torch.randn(6, 3, 2, 2))
    assert y.shape == (6, 3, 2, 2)
    assert int(twin.num_batches_tracked) == 1
