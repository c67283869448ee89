"""CPU thread replicas: sharing, numerics against the direct call, buffers, thread state, bad input."""

from __future__ import annotations

import copy
import threading
from collections import namedtuple
from typing import Any

import pytest
import torch
from replicate_testutils import assert_close
from torch import nn

from pc_replicate import CallbackContext, DataParallelWithCallback, ReplicationCallbackDataParallel

RCDP = ReplicationCallbackDataParallel


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 5 * 5, 6), nn.Softplus()
    ).double()


def test_alias_is_the_same_class() -> None:
    assert DataParallelWithCallback is ReplicationCallbackDataParallel
    dp = RCDP(nn.Linear(2, 2), device_ids=[torch.device("cpu")] * 2)
    assert isinstance(dp, nn.DataParallel)
    assert dp.device_ids == [torch.device("cpu")] * 2
    assert dp.output_device == torch.device("cpu")
    assert dp.dim == 0


@pytest.mark.parametrize(("n", "batch"), [(2, 8), (3, 7), (4, 6)])
def test_outputs_and_gradients_match_the_direct_call(n: int, batch: int) -> None:
    module = _net()
    reference = copy.deepcopy(module)
    x = torch.randn(batch, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    upstream = torch.randn(batch, 6, dtype=torch.float64)

    out = RCDP(module, ["cpu"] * n)(x)
    # (out * upstream).sum() back-propagates ``upstream`` without tensor.backward(gradient), whose first call
    # imports sympy (seconds on a loaded machine)
    (out * upstream).sum().backward()
    expected = reference(x_ref)
    (expected * upstream).sum().backward()

    assert_close(out, expected, atol=1e-12)
    assert_close(x.grad, x_ref.grad, atol=1e-12)
    for (name, p), p_ref in zip(module.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None, name
        assert_close(p.grad, p_ref.grad, atol=1e-12, msg=name)


def test_replicas_share_parameters_replica0_shares_buffers_others_clone() -> None:
    module = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    replicas = RCDP(module, ["cpu"] * 3).replicate(module, ["cpu"] * 3)
    for replica in replicas:
        assert replica is not module
        assert replica[0].weight is module[0].weight
        assert replica[1].bias is module[1].bias
        assert list(replica.parameters()) == list(module.parameters())  # replicas expose parameters()
    assert replicas[0][1].running_mean is module[1].running_mean
    for replica in replicas[1:]:
        assert replica[1].running_mean is not module[1].running_mean
        assert_close(replica[1].running_mean, module[1].running_mean)
    # setting attributes on a replica leaks nothing onto the original
    replicas[1].flag = True
    replicas[1][0].weight_note = "x"
    assert not hasattr(module, "flag")
    assert not hasattr(module[0], "weight_note")
    assert all(not hasattr(m, "_is_replica") for m in module.modules())


def test_plain_batchnorm_keeps_chunk0_statistics() -> None:
    torch.manual_seed(3)
    bn = nn.BatchNorm1d(4, momentum=1.0).double()
    x = torch.randn(8, 4, dtype=torch.float64) * torch.arange(1, 9, dtype=torch.float64)[:, None]
    RCDP(bn, ["cpu"] * 2)(x)
    assert_close(bn.running_mean, x[:4].mean(0))
    assert_close(bn.running_var, x[:4].var(0))
    assert int(bn.num_batches_tracked) == 1


def test_no_grad_inference_mode_and_autocast_reach_the_replicas() -> None:
    seen: list[tuple[bool, bool, bool]] = []
    lock = threading.Lock()

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with lock:
                seen.append(
                    (
                        torch.is_grad_enabled(),
                        torch.is_inference_mode_enabled(),
                        torch.is_autocast_enabled("cpu"),
                    )
                )
            return self.lin(x)

    dp = RCDP(Probe(), ["cpu"] * 2)
    x = torch.randn(4, 4)
    with torch.no_grad():
        out = dp(x)
    assert out.grad_fn is None
    assert seen == [(False, False, False)] * 2
    seen.clear()
    with torch.inference_mode():
        out = dp(x)
    assert out.is_inference()
    assert seen == [(False, True, False)] * 2
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = dp(x)
    assert out.dtype == torch.bfloat16
    assert seen == [(True, False, True)] * 2
    seen.clear()
    out = dp(x)
    assert out.grad_fn is not None
    assert seen == [(True, False, False)] * 2


def test_replicas_run_in_concurrent_threads() -> None:
    barrier = threading.Barrier(3, timeout=10)

    class Meet(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            barrier.wait()  # only passes if all three replicas run at the same time
            return x + 1

    x = torch.randn(3, 2)
    assert_close(RCDP(Meet(), ["cpu"] * 3)(x), x + 1)


def test_kwargs_and_non_tensor_inputs() -> None:
    class Affine(nn.Module):
        def forward(self, x: torch.Tensor, *, scale: float, shift: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"y": x * scale + shift, "n": torch.tensor(x.shape[0])}

    x = torch.randn(6, 2)
    shift = torch.randn(6, 2)
    with pytest.warns(UserWarning, match="scalars"):
        out = RCDP(Affine(), ["cpu"] * 4)(x, scale=3.0, shift=shift)
    assert_close(out["y"], x * 3.0 + shift)
    assert out["n"].tolist() == [2, 2, 2]  # 6 rows on 4 devices: 3 chunks


def test_empty_input_and_none_output() -> None:
    calls: list[int] = []

    class NoInput(nn.Module):
        def forward(self) -> None:
            calls.append(1)

    assert RCDP(NoInput(), ["cpu"] * 2)() is None
    assert calls == [1]  # empty input: one chunk, like torch


def test_dim1_scatter_and_gather() -> None:
    module = nn.Conv1d(2, 3, 1).double()
    x = torch.randn(5, 2, 7, dtype=torch.float64)
    out = RCDP(nn.Identity(), ["cpu"] * 3, dim=2)(x)
    assert_close(out, x)
    assert_close(RCDP(module, ["cpu"] * 2, dim=2)(x), module(x), atol=1e-12)


def test_replica_error_reaches_the_caller_with_its_type_and_replica() -> None:
    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x[0, 0] > 100:
                raise ValueError("bad chunk")
            return x

    x = torch.zeros(6, 2)
    x[4, 0] = 1000  # chunk 2 of 3
    with pytest.raises(ValueError, match="bad chunk") as info:
        RCDP(Fails(), ["cpu"] * 3)(x)
    assert any("replica 2" in note for note in getattr(info.value, "__notes__", []))


def test_replica_error_aborts_peers_blocked_in_a_sync(no_thread_leak: None) -> None:
    """A replica that fails before a sync releases its peers through __data_parallel_abort__.

    Proved by the order of events, not a clock: the peers' barrier has a 60 s timeout, far beyond the
    ``ABORT_JOIN_TIMEOUT`` (10 s) the caller waits for them after the failure, so peers released by the
    timeout would not have reported back when the error surfaces. They have, and after the abort.
    """
    events: list[str] = []

    class Syncing(nn.Module):
        def __data_parallel_replicate__(self, ctx: CallbackContext, copy_id: int) -> None:
            if copy_id == 0:
                ctx.barrier = threading.Barrier(3, timeout=60)
            self.barrier = ctx.barrier
            self.copy_id = copy_id

        def __data_parallel_abort__(self, exc: BaseException) -> None:
            events.append("abort")
            self.barrier.abort()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.copy_id == 1:
                raise ValueError("replica 1 broke")
            try:
                self.barrier.wait()
            except threading.BrokenBarrierError:
                events.append(f"released {self.copy_id}")
                raise
            return x

    with pytest.raises(ValueError, match="replica 1 broke") as info:
        RCDP(Syncing(), ["cpu"] * 3)(torch.randn(3, 2))
    released = [e for e in events if e.startswith("released")]
    assert sorted(released) == ["released 0", "released 2"]  # both peers were out when the error surfaced
    assert events.index("abort") < min(events.index(e) for e in released)
    assert any("replica 1" in note for note in getattr(info.value, "__notes__", []))


def test_primary_error_wins_over_an_earlier_sync_aborted_echo() -> None:
    class SyncAbortedError(RuntimeError):
        pass

    released = threading.Event()

    class Echo(nn.Module):
        def __data_parallel_replicate__(self, ctx: CallbackContext, copy_id: int) -> None:
            self.copy_id = copy_id

        def __data_parallel_abort__(self, exc: BaseException) -> None:
            released.set()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.copy_id == 0:
                raise SyncAbortedError("echo")
            assert released.wait(10)
            raise KeyError("the real failure")

    with pytest.raises(KeyError, match="the real failure"):
        RCDP(Echo(), ["cpu"] * 2)(torch.randn(2, 2))


def test_scatter_dim_out_of_range() -> None:
    dp = RCDP(nn.Linear(2, 2), ["cpu"] * 2, dim=3)
    with pytest.raises(ValueError, match="dim=3 is out of range"):
        dp(torch.randn(4, 2))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"module": "not a module", "device_ids": ["cpu"]}, TypeError, "torch.nn.Module"),
        ({"module": nn.Linear(1, 1), "device_ids": []}, ValueError, "empty"),
        ({"module": nn.Linear(1, 1), "device_ids": ["cpu", 0]}, ValueError, "mixes CPU"),
        ({"module": nn.Linear(1, 1), "device_ids": "cpu"}, TypeError, "list of devices"),
        ({"module": nn.Linear(1, 1), "device_ids": [1.5]}, TypeError, "float"),
        ({"module": nn.Linear(1, 1), "device_ids": ["cpux"]}, ValueError, "not a device name"),
        ({"module": nn.Linear(1, 1), "device_ids": ["cpu"], "dim": 1.0}, TypeError, "dim must be an int"),
        ({"module": nn.Linear(1, 1), "device_ids": ["cpu"], "output_device": 0}, ValueError, "output_device"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        RCDP(**kwargs)  # type: ignore[arg-type]


def test_unreplicable_modules() -> None:
    lazy = nn.LazyLinear(3)
    with pytest.raises(ValueError, match="uninitialized lazy"):
        RCDP(lazy, ["cpu"] * 2)(torch.randn(4, 2))
    scripted = torch.jit.script(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="TorchScript"):
        RCDP(scripted, ["cpu"] * 2)(torch.randn(4, 2))


def test_single_cpu_device_calls_the_module_directly() -> None:
    module = nn.Linear(3, 2)
    x = torch.randn(5, 3)
    assert_close(RCDP(module, ["cpu"])(x), module(x))


def test_no_device_ids_on_a_cpu_only_machine_calls_the_module_directly() -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    calls: list[int] = []

    class Spy(nn.Linear):
        def __data_parallel_replicate__(self, ctx: CallbackContext, copy_id: int) -> None:
            calls.append(copy_id)

    module = Spy(3, 2)
    x = torch.randn(5, 3)
    assert_close(RCDP(module)(x), module(x))
    assert calls == []


Pair = namedtuple("Pair", ["a", "b"])


def test_namedtuple_list_and_dict_inputs_and_outputs() -> None:
    class Structured(nn.Module):
        def forward(self, pair: Pair, items: list[torch.Tensor], table: dict[str, torch.Tensor]) -> Any:
            return Pair(pair.a + items[0], [pair.b * 2, table["t"]])

    a, b, c, t = (torch.randn(6, 2) for _ in range(4))
    out = RCDP(Structured(), ["cpu"] * 4)(Pair(a, b), [c], {"t": t})
    assert isinstance(out, Pair)
    assert_close(out.a, a + c)
    assert isinstance(out.b, list)
    assert_close(out.b[0], b * 2)
    assert_close(out.b[1], t)


def test_outputs_that_cannot_be_gathered() -> None:
    class Mixed(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return x if x[0, 0] > 0 else None

    x = torch.ones(4, 2)
    x[2:] = -1
    with pytest.raises(TypeError, match="different types"):
        RCDP(Mixed(), ["cpu"] * 2)(x)

    class Count(nn.Module):
        def forward(self, x: torch.Tensor) -> int:
            return x.shape[0]

    with pytest.raises(TypeError, match="cannot gather replica outputs of type int"):
        RCDP(Count(), ["cpu"] * 2)(x)

    class Keys(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"pos" if x[0, 0] > 0 else "neg": x}

    with pytest.raises(ValueError, match="same keys"):
        RCDP(Keys(), ["cpu"] * 2)(x)
