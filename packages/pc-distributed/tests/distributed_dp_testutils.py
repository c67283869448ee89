"""Worker functions for the DataParallel/DASO tests; run in every rank of a ``run_world`` (imported by name).

Results travel back as plain Python lists: tensors in ``run_world`` results do not arrive (see the report).
"""

from __future__ import annotations

import os
import signal
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from pc_distributed.parallel.daso.daso import DASO
from pc_distributed.parallel.daso.multigpu import DataParallelMultiGPU
from pc_distributed.parallel.data_parallel import DataParallel
from pc_distributed.parallel.optimizer import DataParallelOptimizer

B = 4  # samples per rank per step
STEPS = 3


class Net(nn.Module):
    """A small net with a tied weight, a root parameter, an ``a + b`` shared gradient and an unused layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 6, bias=False)
        self.hidden = nn.Linear(6, 8)
        self.out = nn.Linear(8, 6)
        self.head = nn.Linear(6, 6, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.scale = nn.Parameter(torch.ones(6))  # owned by the root module
        self.shift_a = nn.Parameter(torch.zeros(6))
        self.shift_b = nn.Parameter(torch.zeros(6))
        self.unused = nn.Linear(3, 3)  # never receives a gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(self.emb(x)))
        o = self.out(h) * self.scale + (self.shift_a + self.shift_b)
        return self.head(torch.tanh(o))


def make_net(seed: int, dtype: torch.dtype, pretrained: bool) -> Net:
    torch.manual_seed(seed)
    net = Net().to(dtype)
    if pretrained:  # weights that a re-seed-and-reset (heat) would lose
        with torch.no_grad():
            for i, p in enumerate(net.parameters()):
                p.add_(0.1 * (i + 1))
    return net


def batches(world: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    n = world * B
    return [tuple(torch.randn(n, 6, generator=g, dtype=dtype) for _ in range(3)) for _ in range(STEPS)]  # type: ignore[misc]


def loss_fn(out: torch.Tensor, y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    # mean squared error plus a random upstream gradient u (never out.sum() alone)
    return ((out - y) ** 2).mean() + (out * u).mean()


def make_sgd(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def oracle(
    world: int, dtype: torch.dtype
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """Single-process full-batch training: parameter snapshots after 0..STEPS steps and each gradient."""
    net = make_net(1, dtype, pretrained=True)
    opt = make_sgd(net)
    snaps = [{k: v.detach().clone() for k, v in net.named_parameters()}]
    grads = []
    for x, y, u in batches(world, dtype):
        opt.zero_grad()
        loss_fn(net(x), y, u).backward()
        grads.append({k: None if v.grad is None else v.grad.clone() for k, v in net.named_parameters()})
        opt.step()
        snaps.append({k: v.detach().clone() for k, v in net.named_parameters()})
    return snaps, grads


def max_err(net: nn.Module, ref: dict[str, torch.Tensor]) -> float:
    return max(float((p.detach() - ref[k]).abs().max()) for k, p in net.named_parameters())


def _train(
    rank: int, world: int, dtype: torch.dtype, blocking: bool, accumulate: bool, cap_mb: float = 25.0
) -> dict[str, Any]:
    snaps, grads = oracle(world, dtype)
    tol = 1e-10 if dtype == torch.float64 else 1e-6
    net = make_net(1, dtype, pretrained=True) if rank == 0 else make_net(100 + rank, dtype, pretrained=False)
    opt = DataParallelOptimizer(make_sgd(net))
    rng = torch.get_rng_state()
    dp = DataParallel(
        net,
        optimizer=opt,
        blocking_parameter_updates=blocking,
        bucket_cap_mb=cap_mb,
        first_bucket_cap_mb=cap_mb,
    )
    assert torch.equal(rng, torch.get_rng_state()), "construction changed the RNG state"
    assert max_err(net, snaps[0]) == 0.0, "replicas do not start from rank 0's (pretrained) weights"
    assert dp.blocking_parameter_updates is blocking
    assert opt.blocking_parameter_updates is blocking
    template = make_net(1, dtype, pretrained=False)
    sl = slice(rank * B, (rank + 1) * B)
    for k, (x, y, u) in enumerate(batches(world, dtype)):
        opt.zero_grad()
        if not accumulate:
            out = dp(x[sl])
            # the forward used the parameters after k steps (non-blocking: applied layer by layer)
            expected = functional_call(template, snaps[k], (x[sl],))
            assert float((out - expected).detach().abs().max()) < tol, (
                f"step {k}: forward used stale parameters"
            )
            loss_fn(out, y[sl], u[sl]).backward()
        else:
            half = slice(rank * B, rank * B + B // 2), slice(rank * B + B // 2, (rank + 1) * B)
            with dp.no_sync():
                (0.5 * loss_fn(dp(x[half[0]]), y[half[0]], u[half[0]])).backward()
            (0.5 * loss_fn(dp(x[half[1]]), y[half[1]], u[half[1]])).backward()
        if blocking:  # averaged gradients are in .grad when backward returns
            for name, p in net.named_parameters():
                ref = grads[k][name]
                if ref is None:
                    assert p.grad is None, f"{name}: unused parameter got a gradient"
                else:
                    assert p.grad is not None, f"{name}: averaged gradient missing"
                    assert float((p.grad - ref).abs().max()) < tol, f"{name}: grad differs"
        opt.step()
    if not blocking:
        assert max_err(net, snaps[STEPS - 1]) < tol, "non-blocking step applied before the next forward"
        dp.eval()  # leaving training mode flushes the pending step
    err = max_err(net, snaps[STEPS])
    assert err < tol, f"parameters differ from single-process SGD by {err}"
    assert net.unused.weight.grad is None
    return {"params": [p.detach().tolist() for p in net.parameters()], "err": err}


def _buffers(rank: int) -> dict[str, Any]:
    torch.manual_seed(rank)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    dp = DataParallel(net, optimizer=opt, blocking_parameter_updates=True)
    for _ in range(2):
        opt.zero_grad()
        x = torch.randn(8, 4) * (rank + 1) + rank
        loss_fn(dp(x), torch.zeros(8, 4), torch.ones(8, 4)).backward()
        opt.step()
    before = net[1].running_mean.clone()
    dp.eval()
    return {
        "before": before.tolist(),
        "after": net[1].running_mean.tolist(),
        "count": int(net[1].num_batches_tracked),
    }


def _rank_dependent_branch(rank: int) -> dict[str, Any]:
    """A layer used only on rank 1: no hang, and its gradient is the average with rank 0's zero."""
    torch.manual_seed(0)
    net = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)})

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = net

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.m["a"](x)
            return self.m["b"](y) if rank == 1 else y

    model = Branchy()
    opt = DataParallelOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    dp = DataParallel(model, optimizer=opt, blocking_parameter_updates=True)
    x = torch.ones(2, 3)
    dp(x).sum().backward()
    opt.step()  # closes the round: rank 0 contributes zeros for the branch
    grad_b = model.m["b"].weight.grad
    assert grad_b is not None, "the branch's averaged gradient is missing"
    return {
        "b_weight": model.m["b"].weight.detach().tolist(),
        "a_weight": model.m["a"].weight.detach().tolist(),
    }


def _overlap(rank: int) -> list[str]:
    """Blocking mode's event order: the last layer's bucket is all-reduced before backward reaches layer 0."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    # buckets in reverse order: [net[2].bias, net[2].weight] (80 bytes >= the first cap), then net[0]'s
    dp = DataParallel(net, optimizer=opt, blocking_parameter_updates=True, first_bucket_cap_mb=64 / 2**20)
    events: list[str] = []
    real_all_reduce = dist.all_reduce

    def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        events.append(f"all_reduce {tensor.numel()}")
        return real_all_reduce(tensor, *args, **kwargs)

    def on_output(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        # fires when backward reaches layer 0, before its weight and bias gradients exist
        output.register_hook(lambda grad: events.append("backward reaches layer 0"))

    handle = net[0].register_forward_hook(on_output)
    dist.all_reduce = spy  # type: ignore[assignment]
    try:
        dp(torch.full((2, 4), float(rank + 1))).sum().backward()
        events.append("backward returned")
    finally:
        dist.all_reduce = real_all_reduce
        handle.remove()
    assert all(p.grad is not None for p in net.parameters()), "averaged gradients missing after backward"
    opt.step()
    return events


def dp_numerics_worker(rank: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    world = dist.get_world_size()
    out: dict[str, Any] = {}
    for name, dtype, blocking, accumulate in [
        ("blocking64", torch.float64, True, False),
        ("nonblocking64", torch.float64, False, False),
        ("blocking32", torch.float32, True, False),
        ("accumulate_blocking", torch.float64, True, True),
        ("accumulate_nonblocking", torch.float64, False, True),
    ]:
        out[name] = _train(rank, world, dtype, blocking, accumulate)
    # many small buckets (about one per parameter): the tied, shared and unused parameters across buckets
    out["blocking64_small_buckets"] = _train(rank, world, torch.float64, True, False, cap_mb=1e-4)
    out["accumulate_blocking_small_buckets"] = _train(rank, world, torch.float64, True, True, cap_mb=1e-4)
    out["overlap"] = _overlap(rank)
    out["buffers"] = _buffers(rank)
    out["branch"] = _rank_dependent_branch(rank)
    out["errors"] = dp_errors_worker(rank)
    return out


def _expect(exc_type: type[BaseException], fn: Any, match: str) -> None:
    try:
        fn()
    except exc_type as exc:
        if match not in str(exc):
            raise AssertionError(f"expected {match!r} in {exc!r}") from exc
        return
    raise AssertionError(f"{fn} did not raise {exc_type.__name__}")


def dp_errors_worker(rank: int) -> dict[str, Any]:
    torch.set_num_threads(1)

    def dpo(params: Any) -> DataParallelOptimizer:
        return DataParallelOptimizer(torch.optim.SGD(params, lr=0.1))

    lin = nn.Linear(4, 4)
    _expect(TypeError, lambda: DataParallel(lin), "got None")
    _expect(
        TypeError, lambda: DataParallel(lin, optimizer=torch.optim.SGD(lin.parameters(), lr=1)), "wrapped"
    )
    _expect(
        TypeError, lambda: DataParallel(lin, comm="world", optimizer=dpo(lin.parameters())), "comm must be"
    )
    _expect(TypeError, lambda: DataParallel("net", optimizer=dpo(lin.parameters())), "torch.nn.Module")  # type: ignore[arg-type]
    # collective checks: every rank raises, none is left waiting
    foreign = nn.Parameter(torch.zeros(2))
    _expect(ValueError, lambda: DataParallel(nn.ReLU(), optimizer=dpo([foreign])), "no trainable parameters")
    _expect(ValueError, lambda: DataParallel(lin, optimizer=dpo([foreign])), "not a trainable parameter")
    other = nn.Linear(4, 4 + rank)
    _expect(
        ValueError,
        lambda: DataParallel(other, optimizer=dpo(other.parameters())),
        "differs from group rank 0",
    )
    opt = dpo([foreign]) if rank == 1 else dpo(lin.parameters())
    msg = "not a trainable parameter" if rank == 1 else "failed on group rank(s) [1]"
    _expect(ValueError, lambda: DataParallel(lin, optimizer=opt), msg)
    # non-blocking refusals and fallbacks
    nb_opt = dpo(lin.parameters())
    dp = DataParallel(lin, optimizer=nb_opt)
    _expect(ValueError, lambda: nb_opt.step(lambda: 0.0), "closure")
    dp.remove_hooks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lb = DataParallelOptimizer(torch.optim.LBFGS(lin.parameters()))
        dp = DataParallel(lin, optimizer=lb)
    assert dp.blocking_parameter_updates
    assert any("LBFGS" in str(w.message) for w in caught)
    dp.remove_hooks()
    # DASO argument checks (local) and the collective local_size check
    sgd = torch.optim.SGD(lin.parameters(), lr=0.1)
    _expect(ValueError, lambda: DASO(sgd, total_epochs=0), "total_epochs must be an int >= 1")
    _expect(ValueError, lambda: DASO(sgd, 3, downcast_type=torch.int8), "downcast_type")
    _expect(TypeError, lambda: DASO(sgd, 3, scheduler=object()), "step()")
    _expect(TypeError, lambda: DASO("sgd", 3), "torch.optim.Optimizer")  # type: ignore[arg-type]
    _expect(ValueError, lambda: DASO(sgd, 3, local_size=1 + rank), "equal on every rank")
    _expect(TypeError, lambda: DataParallelMultiGPU(lin, sgd), "DASO")  # type: ignore[arg-type]
    daso = DASO(sgd, 3, local_size=1, warmup_epochs=1, cooldown_epochs=1)
    DataParallelMultiGPU(lin, daso)
    _expect(ValueError, daso.step, "last_batch")
    # the group still works after all of that
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"sum": float(t)}


def dp_peer_death_worker(rank: int, report: str) -> None:
    torch.set_num_threads(1)
    lin = nn.Linear(4, 4)
    opt = DataParallelOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1))
    dp = DataParallel(lin, optimizer=opt, blocking_parameter_updates=True, timeout=10.0)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dp(torch.ones(2, 4)).sum().backward()
        opt.step()
        outcome = "no error"
    except Exception as exc:  # the survivor's view of the dead peer
        outcome = type(exc).__name__
    with open(report, "w") as fh:
        fh.write(outcome)


def daso_worker(rank: int, epochs: int, batches_per_epoch: int) -> dict[str, Any]:
    """4 processes as 2 simulated nodes x 2: phases, identical parameters after each epoch, falling loss."""
    torch.set_num_threads(1)
    world = dist.get_world_size()
    torch.manual_seed(100 + rank)  # different initial weights: construction must broadcast rank 0's
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    daso = DASO(
        sgd, total_epochs=epochs, warmup_epochs=1, cooldown_epochs=1, max_global_skips=2, local_size=2
    )
    dpm = DataParallelMultiGPU(model, daso)
    g = torch.Generator().manual_seed(7)
    w_true = torch.randn(8, 1, generator=g)
    data = torch.randn(world, batches_per_epoch, 16, 8, generator=g)
    phases, losses, agree = [], [], []
    for _epoch in range(epochs):
        daso.last_batch = batches_per_epoch - 1
        phases.append((daso.global_skip, daso.local_skip, daso.batches_to_wait))
        total = 0.0
        for b in range(batches_per_epoch):
            x = data[rank, b]
            daso.zero_grad()
            loss = ((dpm(x) - x @ w_true) ** 2).mean()
            loss.backward()
            daso.step()
            total += float(loss.detach())
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.zeros_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        agree.append(all(torch.equal(gathered[0], t) for t in gathered))
        losses.append(total / batches_per_epoch)
        daso.epoch_loss_logic(total / batches_per_epoch)
    return {"phases": phases, "losses": losses, "agree": agree, "params": flat.tolist(), "epoch": daso.epoch}


def dp_gpu_worker(rank: int, device_index: int | None = None) -> list[float]:
    """CUDA: blocking DataParallel keeps the ranks identical.

    ``device_index=None`` puts rank r on cuda:r (NCCL, one GPU per rank); an index puts every rank on that one
    GPU (gloo, which accepts ranks that share a device).
    """
    device = torch.device("cuda", rank if device_index is None else device_index)
    torch.cuda.set_device(device)
    torch.manual_seed(rank)
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)).to(device)
    opt = DataParallelOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    dp = DataParallel(net, optimizer=opt, blocking_parameter_updates=True)
    for _ in range(3):
        opt.zero_grad()
        x = torch.randn(4, 8, device=device)
        dp(x).pow(2).mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).cpu().tolist()


def daso_gpu_worker(rank: int, device_index: int | None = None) -> list[float]:
    """CUDA: DASO with one GPU per node ends every epoch with identical parameters.

    ``device_index=None`` puts rank r on cuda:r (NCCL, one GPU per rank); an index puts every rank on that one
    GPU (gloo, which accepts ranks that share a device).
    """
    device = torch.device("cuda", rank if device_index is None else device_index)
    torch.cuda.set_device(device)
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)).to(device)
    daso = DASO(
        torch.optim.SGD(model.parameters(), lr=0.05), 2, warmup_epochs=1, cooldown_epochs=0, local_size=1
    )
    dpm = DataParallelMultiGPU(model, daso)
    daso.last_batch = 3
    for _ in range(4):
        daso.zero_grad()
        dpm(torch.randn(4, 8, device=device)).pow(2).mean().backward()
        daso.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().tolist()
