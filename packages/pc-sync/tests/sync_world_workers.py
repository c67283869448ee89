"""Rank functions for the process-group SyncBatchNorm tests (run under ``pc_distributed.run_world``).

Every rank builds the same global batch and upstream gradient from a seed, runs its own slice through
``pc_sync.SyncBatchNorm`` and a torch batch norm over the whole batch, and returns the largest differences;
the test asserts on them in the parent process. Collectives are counted by wrapping ``torch.distributed``'s
``all_gather`` / ``all_reduce`` in the rank.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import pc_sync

REF_OF_DIM = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


@contextmanager
def count_collectives() -> Iterator[Counter[str]]:
    """Count the ``all_gather`` and ``all_reduce`` calls made through ``torch.distributed`` in this block."""
    counts: Counter[str] = Counter()
    originals = {name: getattr(dist, name) for name in ("all_gather", "all_reduce")}

    def wrap(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, wrap(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _bounds(sizes: list[int], rank: int) -> tuple[int, int]:
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def _randomize(module: nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if t.is_floating_point():
                values = torch.rand(t.shape, generator=gen, dtype=t.dtype) + 0.5
                t.copy_(values if "var" in name else values - 1.0)


def _max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return float(
        (a.detach().cpu().double() - b.detach().cpu().double()).abs().max()
    )  # either may be on a GPU


def layer_cases(n: int) -> dict[str, tuple[tuple[int, ...], dict[str, Any]]]:
    """The layer configurations the process grids run: name -> (global batch shape of ``n`` rows, kwargs)."""
    return {
        "2d": ((n, 4), {}),
        "3d": ((n, 3, 5), {"momentum": None}),
        "4d": ((n, 3, 4, 5), {}),
        "5d": ((n, 2, 3, 2, 4), {}),
        "4d_channels_last": ((n, 3, 4, 5), {"channels_last": True}),
        "affine_false": ((n, 3, 4), {"affine": False}),
        "no_running_stats": ((n, 3, 4), {"track_running_stats": False}),
    }


def compare_layer(
    rank: int,
    sizes: list[int],
    shape: tuple[int, ...],
    *,
    seed: int,
    steps: int = 2,
    channels_last: bool = False,
    replicas: int | Sequence[int] = 0,
    device: str = "cpu",
    fused: bool | Sequence[bool] = False,
    **kwargs: Any,
) -> dict[str, Any]:
    """``steps`` training steps and one eval step; the largest difference to the full-batch reference.

    ``shape`` is the global batch's; rank ``r`` gets rows ``sizes[r]`` of it. ``replicas > 0`` runs the layer
    under ``ReplicationCallbackDataParallel`` over that many CPU thread replicas inside the rank (fewer when
    the rank has fewer rows: torch's chunking); a sequence gives each rank its own. Parameter gradients are
    summed over the ranks (what DDP does, up to its averaging) before the comparison. ``fused`` (per rank, or
    for all) runs the layer on the fused kernels' stand-ins (``pc_sync._torch_bn``) on any device; the result
    then counts their calls under ``"kernel_calls"``.
    """
    from sync_testutils import CountingKernels, reference_bn

    wrapped = replicas if isinstance(replicas, int) else replicas[rank]
    kernels = None
    if fused if isinstance(fused, bool) else fused[rank]:
        kernels = CountingKernels()
    gen = torch.Generator().manual_seed(seed)
    channels = shape[1]
    ref = reference_bn(REF_OF_DIM[len(shape)], channels, torch.float64, **kwargs)
    _randomize(ref, gen)
    ours = pc_sync.SyncBatchNorm(channels, dtype=torch.float64, **kwargs)
    ours.load_state_dict(ref.state_dict())
    ours._bn_kernels = kernels
    ref.to(device)
    ours.to(device)
    model: nn.Module = ours
    if wrapped:
        from pc_replicate import ReplicationCallbackDataParallel

        index = torch.device(device).index
        ids: list[Any] = ["cpu"] * wrapped if device == "cpu" else [index or 0] * wrapped
        model = ReplicationCallbackDataParallel(ours, device_ids=ids)
    lo, hi = _bounds(sizes, rank)
    worst: dict[str, float] = {}
    collectives: list[dict[str, dict[str, int]]] = []

    def note(key: str, value: float) -> None:
        worst[key] = max(worst.get(key, 0.0), value)

    for step in range(steps + 1):
        training = step < steps
        ref.train(training)
        model.train(training)
        x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 3 + 5).to(device)
        g = torch.randn(shape, generator=gen, dtype=torch.float64).to(device)
        if channels_last:
            fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
            x = x.contiguous(memory_format=fmt)
        local_eval = not training and not ours.track_running_stats
        if local_eval:
            # Eval without running statistics normalizes with the local batch's (as torch): no sync.
            x, g, lo, hi = x[lo:hi], g[lo:hi], 0, hi - lo
            if hi == 0:
                collectives.append({})
                continue
        x_ref = x.clone().requires_grad_(True)
        x_ours = x[lo:hi].clone().requires_grad_(True)
        y_ref = ref(x_ref)
        with count_collectives() as forward_counts:
            y_ours = model(x_ours)
        with count_collectives() as backward_counts:
            (y_ours * g[lo:hi]).sum().backward()
        collectives.append({"forward": dict(forward_counts), "backward": dict(backward_counts)})
        (y_ref * g).sum().backward()
        note("output", _max_diff(y_ours, y_ref[lo:hi]))
        note("input_grad", _max_diff(x_ours.grad, x_ref.grad[lo:hi] if x_ref.grad is not None else None))
        if local_eval:
            continue
        for name, p in ours.named_parameters():
            grad = p.grad.cpu() if p.grad is not None else torch.zeros(p.shape, dtype=p.dtype)
            dist.all_reduce(grad)
            ref_p = dict(ref.named_parameters())[name]
            note(f"{name}_grad", _max_diff(grad, ref_p.grad))
            p.grad = None
            ref_p.grad = None
        for name, buf in ours.named_buffers():
            note(name, _max_diff(buf, dict(ref.named_buffers())[name]))
        if channels_last:
            fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
            note("channels_last_kept", 0.0 if y_ours.is_contiguous(memory_format=fmt) else 1.0)
    kernel_calls = dict(kernels.calls) if kernels is not None else {}
    return {"diff": worst, "collectives": collectives, "kernel_calls": kernel_calls}


def grid_world(rank: int) -> dict[str, Any]:
    """Four ranks, uneven batches with an empty rank; every input rank and option; counted collectives."""
    torch.set_num_threads(1)
    sizes = [3, 0, 5, 2]
    n = sum(sizes)
    out: dict[str, Any] = {"widening": _widening(rank)}  # first: the group's exchanges are as wide as 9 after
    cases = layer_cases(n)
    for i, (name, (shape, kwargs)) in enumerate(cases.items()):
        out[name] = compare_layer(rank, sizes, shape, seed=100 + i, **kwargs)
    out["even"] = compare_layer(rank, [2, 2, 2, 2], (8, 3, 3, 3), seed=7)
    out["replicas"] = compare_layer(rank, [4, 6, 5, 3], (18, 3, 2, 3), seed=8, replicas=2)
    out["bfloat16"] = _bfloat16(rank, sizes)
    out["parameter_grads_only"] = _parameter_grads_only(rank, sizes)
    out["one_member"] = _one_member_group(rank)
    out["mixed_recording"] = _mixed_recording(rank)
    out["crossed_backward"] = _crossed_backward(rank)
    out["after_crossed"] = compare_layer(rank, sizes, (n, 3, 2), seed=12)
    return out


def _widening(rank: int) -> list[dict[str, int]]:
    """Forward collectives of layer calls of 5, 5, 3, 9, 9 and 4 channels on a fresh group: a call wider than
    any before sends its header, then (every rank agreeing) its statistics in a packet of the new width.
    """
    seen = []
    for channels in (5, 5, 3, 9, 9, 4):
        bn = pc_sync.SyncBatchNorm(channels)
        x = torch.randn(rank + 2, channels, 3, requires_grad=True)
        with count_collectives() as counts:
            y = bn(x)
        y.sum().backward()
        seen.append(dict(counts))
    return seen


def _crossed_backward(rank: int) -> str:
    """Two independent layers of equal width whose backward rank 0 runs in the other ranks' reverse order."""
    first, second = pc_sync.SyncBatchNorm(3), pc_sync.SyncBatchNorm(3)
    gen = torch.Generator().manual_seed(rank)
    x1, x2 = (torch.randn(4, 3, generator=gen, requires_grad=True) for _ in range(2))
    losses = [(first(x1) * torch.randn(4, 3, generator=gen)).sum(), second(x2).square().sum()]
    try:
        for loss in losses if rank == 0 else losses[::-1]:
            loss.backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def _bfloat16(rank: int, sizes: list[int]) -> dict[str, float]:
    """A bf16 input under CPU autocast: bf16 output, fp32 statistics of the whole batch."""
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(sum(sizes), 3, 4, 4, generator=gen) * 2 + 10).to(torch.bfloat16)
    ours = pc_sync.SyncBatchNorm(3)
    ref = nn.BatchNorm2d(3, dtype=torch.float64)
    lo, hi = _bounds(sizes, rank)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ours(x[lo:hi].clone().requires_grad_(True))
    y_ref = ref(x.double())
    return {
        "output_is_bf16": 0.0 if y.dtype == torch.bfloat16 else 1.0,
        "stats_are_fp32": 0.0 if ours.running_mean.dtype == torch.float32 else 1.0,  # type: ignore[union-attr]
        "running_mean": _max_diff(ours.running_mean, ref.running_mean),
        "running_var": _max_diff(ours.running_var, ref.running_var) / float(ref.running_var.abs().max()),  # type: ignore[union-attr]
        "output": _max_diff(y, y_ref[lo:hi]),
    }


def _parameter_grads_only(rank: int, sizes: list[int]) -> dict[str, Any]:
    """An input that does not require grad and a weight without a bias: the weight's gradient alone."""
    gen = torch.Generator().manual_seed(13)
    n = sum(sizes)
    ours = pc_sync.SyncBatchNorm(3, dtype=torch.float64, bias=False)
    ref = nn.BatchNorm2d(3, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(3, generator=gen, dtype=torch.float64) + 0.5)
        ref.bias.zero_()
        ours.weight.copy_(ref.weight)  # type: ignore[union-attr]
    ref.bias.requires_grad_(False)
    x = torch.randn(n, 3, 2, 2, generator=gen, dtype=torch.float64) * 3 + 5
    g = torch.randn(n, 3, 2, 2, generator=gen, dtype=torch.float64)
    lo, hi = _bounds(sizes, rank)
    with count_collectives() as counts:
        y = ours(x[lo:hi])
        (y * g[lo:hi]).sum().backward()
    y_ref = ref(x)
    (y_ref * g).sum().backward()
    grad = ours.weight.grad.clone()  # type: ignore[union-attr]
    dist.all_reduce(grad)
    return {
        "bias_is_none": ours.bias is None,
        "collectives": dict(counts),
        "diff": {
            "output": _max_diff(y, y_ref[lo:hi]),
            "weight_grad": _max_diff(grad, ref.weight.grad),
            "running_mean": _max_diff(ours.running_mean, ref.running_mean),
            "running_var": _max_diff(ours.running_var, ref.running_var),
        },
    }


def _one_member_group(rank: int) -> dict[str, Any]:
    """A group of one process: a plain batch norm on the local batch, no collective."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(5, 3, 4, generator=gen, dtype=torch.float64)
    ours = pc_sync.SyncBatchNorm(3, process_group=groups[rank], dtype=torch.float64)
    ref = nn.BatchNorm1d(3, dtype=torch.float64)
    with count_collectives() as counts:
        y = ours(x)
    foreign = pc_sync.SyncBatchNorm(3, process_group=groups[(rank + 1) % len(groups)])
    try:
        foreign(x.float())
        not_member = "no error"
    except ValueError as exc:
        not_member = str(exc)
    return {
        "not_member": not_member,
        "output": _max_diff(y, ref(x)),
        "running_var": _max_diff(ours.running_var, ref.running_var),
        "collectives": dict(counts),
    }


def _mixed_recording(rank: int) -> str:
    """Rank 0 runs without autograd while the others record: every rank must refuse in forward."""
    bn = pc_sync.SyncBatchNorm(3)
    x = torch.randn(4, 3, requires_grad=True)
    try:
        with torch.set_grad_enabled(rank != 0):
            bn(x)
    except ValueError as exc:
        return str(exc)
    return "no error"


# ------------------------------------------------------------------------------------------------ training
def small_cnn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 3),
    ).double()


def _train(step: Callable[[torch.Tensor, torch.Tensor], None], sizes: list[int], rank: int) -> None:
    gen = torch.Generator().manual_seed(21)
    lo, hi = _bounds(sizes, rank)
    for _ in range(3):
        x = torch.randn(sum(sizes), 3, 5, 5, generator=gen, dtype=torch.float64)
        g = torch.randn(sum(sizes), 3, generator=gen, dtype=torch.float64)
        step(x[lo:hi], g[lo:hi])


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def wrappers_world(rank: int) -> dict[str, Any]:
    """Two ranks: three SGD steps of a small CNN under DDP, under pc_distributed.DataParallel, and on two
    thread replicas inside each rank; every state must equal the full-batch single-process training.
    """
    import pc_distributed
    from pc_replicate import ReplicationCallbackDataParallel

    torch.set_num_threads(1)
    world = dist.get_world_size()
    sizes = [4, 6]

    reference = small_cnn(0)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    def ref_step(x: torch.Tensor, g: torch.Tensor) -> None:
        ref_opt.zero_grad()
        (reference(x) * g).sum().backward()
        ref_opt.step()

    _train(ref_step, [sum(sizes)], 0)
    expected = _state(reference)
    out: dict[str, Any] = {}

    ddp_model = pc_sync.convert_sync_batchnorm(small_cnn(0))
    ddp = nn.parallel.DistributedDataParallel(ddp_model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    counts_seen: list[dict[str, int]] = []

    def ddp_step(x: torch.Tensor, g: torch.Tensor) -> None:
        opt.zero_grad()
        with count_collectives() as counts:
            (ddp(x) * g).sum().mul(world).backward()
        counts_seen.append(dict(counts))
        opt.step()

    _train(ddp_step, sizes, rank)
    out["ddp"] = {k: _max_diff(v, expected[k]) for k, v in _state(ddp_model).items()}
    out["ddp_collectives"] = counts_seen

    for name, blocking in (("pc_data_parallel", True), ("pc_data_parallel_deferred", False)):
        pc_model = pc_sync.convert_sync_batchnorm(small_cnn(0))
        pc_opt = pc_distributed.DataParallelOptimizer(torch.optim.SGD(pc_model.parameters(), lr=0.1))
        pc_dp = pc_distributed.DataParallel(pc_model, optimizer=pc_opt, blocking_parameter_updates=blocking)

        def pc_step(
            x: torch.Tensor,
            g: torch.Tensor,
            pc_dp: nn.Module = pc_dp,
            pc_opt: pc_distributed.DataParallelOptimizer = pc_opt,
        ) -> None:
            pc_opt.zero_grad()
            (pc_dp(x) * g).sum().mul(world).backward()
            pc_opt.step()

        _train(pc_step, sizes, rank)
        pc_dp.flush()  # the deferred mode's last update is applied here
        out[name] = {k: _max_diff(v, expected[k]) for k, v in _state(pc_model).items()}

    two_level = pc_sync.convert_sync_batchnorm(small_cnn(0))
    inner = ReplicationCallbackDataParallel(two_level, device_ids=["cpu"] * 2)
    opt2 = torch.optim.SGD(two_level.parameters(), lr=0.1)
    counts2: list[dict[str, int]] = []

    def two_level_step(x: torch.Tensor, g: torch.Tensor) -> None:
        opt2.zero_grad()
        with count_collectives() as counts:
            (inner(x) * g).sum().mul(world).backward()
        counts2.append(dict(counts))
        # Average the parameter gradients over the processes, as DDP would.
        for p in two_level.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        opt2.step()

    _train(two_level_step, sizes, rank)
    out["replicas_in_processes"] = {k: _max_diff(v, expected[k]) for k, v in _state(two_level).items()}
    out["replicas_collectives"] = counts2
    return out


# ------------------------------------------------------------------------------------------------ failures
def failing_world(rank: int, mode: str) -> dict[str, str]:
    """Rank 1 raises (``mode="raise"``), dies (``"die"``) or stalls past the group's timeout (``"stall"``,
    until rank 0 releases it through the store) instead of reaching the layer; rank 0 reports what it got.
    """
    import pc_distributed

    torch.set_num_threads(1)
    world = pc_distributed.get_world()
    assert world is not None
    bn = pc_sync.SyncBatchNorm(3)
    x = torch.randn(4, 3, 2, requires_grad=True)
    bn(x).sum().backward()  # one good step first: the group works
    if rank == 1:
        if mode == "die":
            os._exit(3)
        if mode == "stall":
            world.waits.wait(["released"], 120.0)
            return {"type": "released", "message": ""}
        raise RuntimeError("rank 1 failed before its batch norm")
    try:
        bn(x).sum().backward()
    except (ConnectionError, TimeoutError) as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    finally:
        if mode == "stall":
            world.store.set("released", b"1")
    return {"type": "no error", "message": ""}


# ------------------------------------------------------------------------------------------------ GPUs
def shared_gpu_world(rank: int) -> dict[str, Any]:
    """Two ranks on one GPU over gloo: CUDA tensors through the same collectives as on CPU."""
    torch.cuda.set_device(0)
    return {
        "4d": compare_layer(rank, [3, 5], (8, 3, 4, 5), seed=31, device="cuda:0"),
        "empty_rank": compare_layer(rank, [0, 6], (6, 3, 2, 3), seed=32, device="cuda:0"),
    }


def shared_gpu_fused_world(rank: int) -> dict[str, Any]:
    """Two ranks on one GPU over gloo, on torch's fused kernels (chosen for CUDA tensors): path pairings."""
    torch.cuda.set_device(0)
    return {
        "float64_no_wrapper_and_two_replicas": compare_layer(
            rank, [3, 6], (9, 3, 4, 5), seed=33, device="cuda:0", replicas=[0, 2]
        ),
        "float64_one_replica_and_two": compare_layer(
            rank, [1, 6], (7, 3, 2, 3), seed=34, device="cuda:0", replicas=[2, 2]
        ),
        "float64_empty_and_two_replicas": compare_layer(
            rank, [0, 5], (5, 3, 2, 3), seed=35, device="cuda:0", replicas=[0, 2]
        ),
        "float64_channels_last": compare_layer(
            rank, [4, 4], (8, 3, 4, 5), seed=36, device="cuda:0", channels_last=True
        ),
    }


def nccl_vs_torch_world(rank: int) -> dict[str, float]:
    """One GPU per rank, NCCL, DDP: pc_sync.SyncBatchNorm against torch.nn.SyncBatchNorm, step by step."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    sizes = [3, 5]
    lo, hi = _bounds(sizes, rank)
    states = {}
    outputs = {}
    for name, convert in (
        ("pc", pc_sync.convert_sync_batchnorm),
        ("torch", nn.SyncBatchNorm.convert_sync_batchnorm),
    ):
        model = convert(small_cnn(0).float()).to(device)
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[rank])
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(41)
        outs = []
        for _ in range(3):
            x = torch.randn(sum(sizes), 3, 5, 5, generator=gen)[lo:hi].to(device)
            g = torch.randn(sum(sizes), 3, generator=gen)[lo:hi].to(device)
            opt.zero_grad()
            y = ddp(x)
            (y * g).sum().backward()
            opt.step()
            outs.append(y.detach())
        states[name] = _state(model)
        outputs[name] = torch.cat(outs)
    diff = {k: _max_diff(v, states["torch"][k]) for k, v in states["pc"].items()}
    diff["outputs"] = _max_diff(outputs["pc"], outputs["torch"])
    return diff
