"""Training checks that multihost_worker.py runs inside one torchrun job across simulated hosts.

Each check returns plain JSON-able observations; test_integration_multihost.py asserts on them. Every rank
runs every check, in the same order (they are collective). The hosts are torchrun's nodes: ``GROUP_RANK``
and ``LOCAL_WORLD_SIZE`` come from torchrun's environment, nothing is simulated.

Checks:
    data_parallel: DataParallel (blocking and non-blocking parameter updates) trained on this rank's slice of
        each batch equals single-process full-batch SGD (float64); rank 0's weights win at construction.
    daso: DASO with its nodes taken from torchrun (``LOCAL_WORLD_SIZE``): the node-local groups hold exactly
        one host's ranks, the global ("column") groups one rank of every host; parameters agree after every
        epoch and the loss falls.
    grad_server: a PushPullGradServerImpl with its primary on host 0 and a secondary on host 0 and on host 1;
        the ranks of the other hosts push integer gradients (SGD with lr 1, ``reduce_method="sum"``: the final
        weights are exactly minus the sum of what was applied); every client pulls the final model across
        hosts; the ledger balances.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pc_distributed import DASO, DataParallel, DataParallelMultiGPU, DataParallelOptimizer, RpcGroup

__all__ = [
    "CHECKS",
    "DP_STEPS",
    "ELASTIC_B",
    "ELASTIC_CHECKPOINT",
    "ELASTIC_STEPS",
    "SERVER_PUSHES",
    "elastic_batches",
    "elastic_loss",
    "elastic_net",
    "elastic_oracle",
    "elastic_sgd",
    "run_checks",
]

B = 3  # samples per rank and step
DP_STEPS = 3
DASO_EPOCHS, DASO_BATCHES = 3, 4
SERVER_PUSHES = 4  # per client
SERVER_DIM = 5
WAIT = 60.0


# -- DataParallel ---
def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _batches(size: int, steps: int = DP_STEPS) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1234)
    return [
        tuple(torch.randn(size * B, d, generator=g, dtype=torch.float64) for d in (6, 3, 3))
        for _ in range(steps)
    ]


def _loss(out: torch.Tensor, y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean() + (out * u).mean()  # a random upstream gradient u, not out.sum()


def _sgd(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def _oracle(size: int, steps: int = DP_STEPS) -> list[torch.Tensor]:
    """Single-process SGD on the full batches."""
    net = _net(1)
    opt = _sgd(net)
    for x, y, u in _batches(size, steps):
        opt.zero_grad()
        _loss(net(x), y, u).backward()
        opt.step()
    return [p.detach() for p in net.parameters()]


def data_parallel(rank: int, size: int) -> dict[str, Any]:
    """DataParallel, blocking and non-blocking: max |parameter - single-process SGD| after DP_STEPS steps."""
    ref = _oracle(size)
    out: dict[str, Any] = {}
    sl = slice(rank * B, (rank + 1) * B)
    for blocking in (True, False):
        net = _net(1 if rank == 0 else 100 + rank)  # different replicas: construction broadcasts rank 0's
        opt = DataParallelOptimizer(_sgd(net))
        dp = DataParallel(net, optimizer=opt, blocking_parameter_updates=blocking)
        for x, y, u in _batches(size):
            opt.zero_grad()
            _loss(dp(x[sl]), y[sl], u[sl]).backward()
            opt.step()
        dp.eval()  # leaving training mode applies a pending non-blocking step
        err = max(float((p.detach() - r).abs().max()) for p, r in zip(net.parameters(), ref, strict=True))
        out["blocking" if blocking else "nonblocking"] = err
        dp.remove_hooks()
    return out


# -- the elastic restart (multihost_worker.py's ``elastic`` scenario): the same model, data and optimizer ---
ELASTIC_B = B
ELASTIC_STEPS = 6
ELASTIC_CHECKPOINT = 3  # steps before rank 0's checkpoint (and the kill)


def elastic_net(rank: int) -> nn.Module:
    """Rank ``rank``'s replica before DataParallel broadcasts rank 0's."""
    return _net(1 if rank == 0 else 100 + rank)


def elastic_sgd(net: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum (state a restart must restore)."""
    return _sgd(net)


def elastic_batches(size: int) -> list[tuple[torch.Tensor, ...]]:
    """The full batches of every step (rank ``r`` trains on rows ``r*B`` to ``(r+1)*B``)."""
    return _batches(size, ELASTIC_STEPS)


def elastic_loss(out: torch.Tensor, y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The loss of every step."""
    return _loss(out, y, u)


def elastic_oracle(size: int) -> list[list[float]]:
    """The uninterrupted result: single-process SGD over every step, flattened per parameter."""
    return [p.reshape(-1).tolist() for p in _oracle(size, ELASTIC_STEPS)]


# -- DASO ---
def _gather_ints(value: int, group: dist.ProcessGroup) -> list[int]:
    n = dist.get_world_size(group)
    got = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(got, torch.tensor([value], dtype=torch.int64), group=group)
    return [int(t.item()) for t in got]


def daso(rank: int, size: int) -> dict[str, Any]:
    """DASO on torchrun's nodes: topology, agreement after every epoch, falling loss."""
    torch.manual_seed(100 + rank)  # different initial weights: construction broadcasts rank 0's
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = DASO(
        sgd, total_epochs=DASO_EPOCHS, warmup_epochs=1, cooldown_epochs=1, max_global_skips=2, timeout=WAIT
    )
    net = DataParallelMultiGPU(model, opt)
    topo = opt.topology
    host = int(os.environ["GROUP_RANK"])
    out: dict[str, Any] = {
        "topology": [topo.node, topo.local_rank, topo.local_size, topo.nodes],
        "local_group_hosts": _gather_ints(host, topo.local_group),
        "column_group_hosts": _gather_ints(host, topo.column_group),
    }
    g = torch.Generator().manual_seed(7)
    w_true = torch.randn(8, 1, generator=g)
    data = torch.randn(size, DASO_BATCHES, 16, 8, generator=g)
    phases, losses, agree = [], [], []
    for _epoch in range(DASO_EPOCHS):
        opt.last_batch = DASO_BATCHES - 1
        phases.append([opt.global_skip, opt.local_skip, opt.batches_to_wait])
        total = 0.0
        for b in range(DASO_BATCHES):
            x = data[rank, b]
            opt.zero_grad()
            loss = ((net(x) - x @ w_true) ** 2).mean()
            loss.backward()
            opt.step()
            total += float(loss.detach())
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.zeros_like(flat) for _ in range(size)]
        dist.all_gather(gathered, flat)
        agree.append(all(torch.equal(gathered[0], t) for t in gathered))
        losses.append(total / DASO_BATCHES)
        opt.epoch_loss_logic(total / DASO_BATCHES)
    out.update(phases=phases, losses=losses, agree=agree)
    return out


# -- pc-server ---
class _Vec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(SERVER_DIM, dtype=torch.float64))


def _grad(rank: int, i: int) -> list[int]:
    return [(rank * 7 + i * 3 + k) % 5 - 2 for k in range(SERVER_DIM)]


def grad_server(rank: int, size: int, group: RpcGroup) -> dict[str, Any]:
    """Primary on host 0; secondaries on host 0 and host 1; clients on every host but 0."""
    from pc_server import PushPullGradServerImpl

    local = int(os.environ["LOCAL_WORLD_SIZE"])
    names = group.get_group_members()
    primary, secondaries = names[0], [names[1], names[local]]
    clients = names[local:]
    me = group.get_cur_name()
    out: dict[str, Any] = {"role": []}
    impl = None
    if me in (primary, *secondaries):
        impl = PushPullGradServerImpl(
            "gs",
            group,
            primary_reducer=primary,
            secondary_reducers=secondaries,
            reduce_batch_size=2,
            flush_timeout=0.2,
        )
        if me == primary:
            model = _Vec()
            impl.manage_model(model, torch.optim.SGD(model.parameters(), lr=1.0))
            out["role"].append("primary")
        if me in secondaries:
            out["role"].append("secondary")
        impl.start()
    group.barrier(WAIT)  # paired and started
    gs = group.get_paired("gs").to_here()
    if me in clients:
        out["role"].append("client")
        model = _Vec()
        accepted = 0
        for i in range(SERVER_PUSHES):
            model.w.grad = torch.tensor(_grad(rank, i), dtype=torch.float64)
            accepted += bool(gs.push(model))
        out["accepted"] = accepted
        out["client_id"] = gs.client_id
    group.barrier(WAIT)  # every push returned (queued)
    if impl is not None:
        impl.stop(timeout=WAIT)
        impl.watch()
    group.barrier(WAIT)  # every reducer drained and stopped
    if me in clients:
        model = _Vec()
        gs.pull(model)  # the final model, from host 0
        out["pulled"] = [float(v) for v in model.w.detach()]
    if me == primary:
        assert impl is not None
        assert impl.model is not None
        out["weights"] = [float(v) for v in impl.model.w.detach()]
        ledger = gs.ledger()  # asked of every reducer, on both hosts
        out["ledger_total"] = vars(ledger.total)
        out["ledger_clients"] = {c: vars(n) for c, n in ledger.clients.items()}
        out["balanced"] = ledger.balanced()
    group.barrier(WAIT)
    return out


def expected_server_weights(clients: list[int]) -> list[float]:
    """Minus the sum of every gradient the ``clients`` (ranks) push."""
    total = [0] * SERVER_DIM
    for r in clients:
        for i in range(SERVER_PUSHES):
            total = [a + b for a, b in zip(total, _grad(r, i), strict=True)]
    return [-float(v) for v in total]


CHECKS: dict[str, Callable[[int, int, RpcGroup], dict[str, Any]]] = {
    "data_parallel": lambda rank, size, group: data_parallel(rank, size),
    "daso": lambda rank, size, group: daso(rank, size),
    "grad_server": grad_server,
}


def run_checks(rank: int, size: int, group: RpcGroup, names: list[str]) -> dict[str, Any]:
    """Run the checks ``names`` (keys of :data:`CHECKS`) in order; one that raises is recorded
    (``{"error": ...}``) and ends the sequence."""
    out: dict[str, Any] = {}
    for name in names:
        start = time.monotonic()
        try:
            out[name] = CHECKS[name](rank, size, group)
        except Exception as exc:  # reported to the test, which fails naming it
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            break
        out[name]["seconds"] = time.monotonic() - start  # printed by the test, never checked
    return out
