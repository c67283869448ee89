"""The original gradient-descent placement surrogate, kept for ``method="gradient"`` and for comparison.

The surrogate optimises a softmax placement matrix against four soft terms (normalised traffic x distance, a
relu of memory overflow, squared mismatch of compute share and device share, and entropy). It does not
minimise the real cost and treats memory as soft, which is why ``method="gradient"`` repairs its argmax
afterwards and is documented as not recommended. Every normaliser here is guarded (no NaN for empty
traffic, one device or zero speeds) and the start is drawn from a local generator seeded by ``seed``.
"""

from __future__ import annotations

import torch

from pc_assigner._core import Compiled

__all__ = ["gradient_search", "optimize_placement"]

_TINY = 1e-30


def _normalized(x: torch.Tensor) -> torch.Tensor:
    total = x.sum()
    return x / total if float(total) > 0 else torch.zeros_like(x)


def optimize_placement(
    optimizer: torch.optim.Optimizer,
    placement: torch.Tensor,
    model_size: torch.Tensor,
    size_capacity: torch.Tensor,
    model_complexity: torch.Tensor,
    complexity_capacity: torch.Tensor,
    model_connection: torch.Tensor,
    device_distance: torch.Tensor,
    connection_weight: float,
    size_match_weight: float,
    complexity_match_weight: float,
    entropy_weight: float,
) -> torch.Tensor:
    """One optimizer step of the placement surrogate (n models, m devices); returns the surrogate loss.

    Args:
        optimizer: Optimizer over ``placement``.
        placement: Logits, shape ``[n, m]``, ``requires_grad=True``.
        model_size: Shape ``[1, n]``.
        size_capacity: Shape ``[1, m]``.
        model_complexity: Shape ``[1, n]``.
        complexity_capacity: Shape ``[1, m]``.
        model_connection: Shape ``[n, n]``.
        device_distance: Shape ``[m, m]``.
        connection_weight: Weight of the traffic x distance term.
        size_match_weight: Weight of the memory-overflow term.
        complexity_match_weight: Weight of the compute-balance term.
        entropy_weight: Weight of the entropy term.

    Returns:
        The detached surrogate loss of this step (finite for every valid input).
    """
    prob = torch.softmax(placement, dim=-1)
    n = prob.shape[0]
    model_distance = torch.einsum("ij,mn,jn->im", prob, prob, _normalized(device_distance))
    model_distance = model_distance * (1 - torch.eye(n, dtype=prob.dtype))
    connection_cost = _normalized(model_connection) * model_distance
    size_match_cost = torch.relu(model_size @ prob - size_capacity)
    cmplx_match_cost = (_normalized(model_complexity) @ prob - _normalized(complexity_capacity)) ** 2
    entropy_cost = -(prob * torch.log(prob.clamp_min(_TINY))).sum(dim=-1)
    total = (
        connection_cost.mean() * connection_weight
        + size_match_cost.mean() * size_match_weight
        + cmplx_match_cost.mean() * complexity_match_weight
        + entropy_cost.mean() * entropy_weight
    )
    optimizer.zero_grad()
    total.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    return total.detach()


def gradient_search(
    c: Compiled,
    *,
    seed: int = 0,
    iterations: int = 500,
    update_rate: float = 0.01,
    connection_weight: float = 2.0,
    size_match_weight: float = 0.01,
    complexity_match_weight: float = 1.0,
    entropy_weight: float = 1.0,
    size_unit: float = 2.0**20,
    complexity: tuple[float, ...] | None = None,
    speeds: tuple[float, ...] | None = None,
) -> list[int]:
    """Run the surrogate for ``iterations`` Adam steps and return the argmax (not repaired).

    Args:
        c: The compiled problem.
        seed: Seed of the starting logits (a local generator; the global RNG is untouched).
        iterations: Adam steps.
        update_rate: Adam learning rate.
        connection_weight: Weight of the traffic term.
        size_match_weight: Weight of the memory-overflow term.
        complexity_match_weight: Weight of the compute-share term.
        entropy_weight: Weight of the entropy term.
        size_unit: Sizes and capacities are divided by this before the surrogate sees them (originally MB;
            the surrogate's result depends on the unit, one of its defects).
        complexity: Per-item complexity the surrogate balances (originally the sizes); default: item time on
            the fastest device.
        speeds: Per-device compute capacity the surrogate balances against; default 1.0 each.

    Returns:
        One eligible-device index per item.
    """
    n, m = c.n, c.m
    if n == 0:
        return []
    f32 = torch.float32
    gen = torch.Generator().manual_seed(seed)
    placement = torch.randn((n, m), generator=gen, dtype=f32).requires_grad_(True)
    optimizer = torch.optim.Adam([placement], lr=update_rate)
    model_size = torch.tensor(c.size, dtype=f32).view(1, n) / size_unit
    capacity = torch.tensor([min(x, 3.0e38) for x in c.cap], dtype=f32).view(1, m) / size_unit
    if complexity is None:
        complexity = tuple(min(row) for row in c.time)
    if speeds is None:
        speeds = tuple(1.0 for _ in range(m))
    model_cmplx = torch.tensor(complexity, dtype=f32).view(1, n)
    cmplx_cap = torch.tensor(speeds, dtype=f32).view(1, m)
    conn = torch.zeros((n, n), dtype=f32)
    for i, k, w in c.edges:
        conn[i, k] = w
    dist = torch.tensor(c.dist, dtype=f32)
    for _ in range(iterations):
        optimize_placement(
            optimizer,
            placement,
            model_size,
            capacity,
            model_cmplx,
            cmplx_cap,
            conn,
            dist,
            connection_weight,
            size_match_weight,
            complexity_match_weight,
            entropy_weight,
        )
    return [int(j) for j in placement.detach().argmax(dim=1).tolist()]
