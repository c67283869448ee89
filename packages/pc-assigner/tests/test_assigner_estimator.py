"""ModelSizeEstimator: exact byte counts for hand-built modules, every dtype, sharing, meta-device FLOPs."""

from __future__ import annotations

import pytest
import torch

from pc_assigner import MIB, ModelSizeEstimator


def _bytes(est: ModelSizeEstimator) -> tuple[float, float, float]:
    return est.get_parameter_sizes() * MIB, est.get_buffer_sizes() * MIB, est.estimate_size() * MIB


def test_machin_fixture_exact_bytes() -> None:
    model = torch.nn.Module()
    for name, dtype in [("p1", torch.int8), ("p2", torch.int16), ("p3", torch.int32), ("p4", torch.float64)]:
        model.register_parameter(name, torch.nn.Parameter(torch.zeros(10, dtype=dtype), requires_grad=False))
    model.register_buffer("b1", torch.zeros(10, dtype=torch.float32))
    est = ModelSizeEstimator(model, size_multiplier=1)
    assert _bytes(est) == (150.0, 40.0, 190.0)
    assert ModelSizeEstimator(model).estimate_size() == 380 / MIB  # default multiplier 2


def test_accelerate_fixture_and_half() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 5))
    assert _bytes(ModelSizeEstimator(model, 1)) == (196.0, 40.0, 236.0)
    model.half()  # num_batches_tracked stays int64 (8 B)
    assert _bytes(ModelSizeEstimator(model, 1)) == (98.0, 24.0, 122.0)


@pytest.mark.parametrize(
    ("dtype", "nbytes"),
    [
        (torch.bfloat16, 20),
        (torch.float16, 20),
        (torch.complex32, 40),
        (torch.complex64, 80),
        (torch.complex128, 160),
        (torch.float8_e4m3fn, 10),
        (torch.float8_e5m2, 10),
        (torch.uint16, 20),
        (torch.uint32, 40),
        (torch.uint64, 80),
        (torch.bool, 10),
        (torch.int64, 80),
    ],
)
def test_every_dtype_counts_its_itemsize(dtype: torch.dtype, nbytes: int) -> None:
    model = torch.nn.Module()
    with pytest.warns(UserWarning, match="ComplexHalf") if dtype == torch.complex32 else NullContext():
        t = torch.zeros(10, dtype=dtype)
    model.register_buffer("b", t)
    assert ModelSizeEstimator(model, 1).get_buffer_sizes() * MIB == nbytes


class NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_tied_weights_and_views_count_once() -> None:
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied
    model = torch.nn.Sequential(emb, head)
    assert ModelSizeEstimator(model, 1).get_parameter_sizes() * MIB == 160
    # a buffer that is a view of a parameter's storage is not counted again
    holder = torch.nn.Module()
    holder.register_parameter("w", torch.nn.Parameter(torch.zeros(8)))
    holder.register_buffer("view", holder.w.detach()[:4])
    assert _bytes(ModelSizeEstimator(holder, 1)) == (32.0, 0.0, 32.0)


def test_meta_flops_and_activations_without_touching_the_model() -> None:
    n, a, b = 8, 16, 32
    lin = torch.nn.Linear(a, b, bias=False)
    ptr, dev = lin.weight.data_ptr(), lin.weight.device
    est = ModelSizeEstimator(lin, example_inputs=(torch.randn(n, a),))
    # forward 2*n*a*b; the backward of out.sum() computes only the weight grad (another 2*n*a*b)
    assert est.estimate_flops() == 4 * n * a * b
    assert est.estimate_activation_size() * MIB == n * b * 4
    req = est.requirements()
    assert (req.parameters, req.buffers, req.gradients, req.optimizer_state, req.activations) == (
        a * b * 4,
        0,
        a * b * 4,
        2 * a * b * 4,
        n * b * 4,
    )
    assert est.estimate_training_size() * MIB == req.training_bytes == 4 * a * b * 4 + n * b * 4
    assert lin.weight.data_ptr() == ptr
    assert lin.weight.device == dev
    assert not lin._forward_hooks  # hooks removed


def test_estimator_bad_input() -> None:
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        ModelSizeEstimator("model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"size_multiplier"):
        ModelSizeEstimator(torch.nn.Linear(1, 1), size_multiplier=-1)
    with pytest.raises(TypeError, match="tuple"):
        ModelSizeEstimator(torch.nn.Linear(1, 1), example_inputs=[torch.zeros(1)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="example_inputs"):
        ModelSizeEstimator(torch.nn.Linear(1, 1)).estimate_flops()

    class ReadsValues(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * float(x.sum())  # needs real data: impossible on meta

    with pytest.raises(RuntimeError, match="meta-device forward"):
        ModelSizeEstimator(ReadsValues(), example_inputs=(torch.ones(2),)).estimate_flops()
