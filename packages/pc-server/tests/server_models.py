"""Models shared by the pc-server tests (importable in spawned children)."""

from __future__ import annotations

import io
from typing import Any

import torch
from torch import nn


class ThreeLayer(nn.Module):
    """machin's test model: three 1x1 linear layers without bias, weights 1, 2, 3 (output = 6 x)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(1, 1, bias=False)
        self.fc2 = nn.Linear(1, 1, bias=False)
        self.fc3 = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.fc1.weight.fill_(1)
            self.fc2.weight.fill_(2)
            self.fc3.weight.fill_(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.fc2(self.fc1(x)))

    def weights(self) -> tuple[float, float, float]:
        return (self.fc1.weight.item(), self.fc2.weight.item(), self.fc3.weight.item())


class PlainSGD:
    """machin's test optimizer: p -= lr * p.grad (lr 1 by default), with torch-like ``param_groups``.

    It avoids ``torch.optim``, whose first use imports torch._dynamo (seconds) in every spawned child.
    """

    def __init__(self, params: object, lr: float = 1.0) -> None:
        self.params = list(params)  # type: ignore[call-overload]
        self.param_groups = [{"lr": lr}]
        self.steps = 0

    def step(self) -> None:
        lr = self.param_groups[0]["lr"]
        with torch.no_grad():
            for p in self.params:
                p -= lr * p.grad
        self.steps += 1


class HalvingScheduler:
    """A StepLR(step_size=1, gamma=0.5) stand-in for PlainSGD."""

    def __init__(self, optimizer: PlainSGD) -> None:
        self.optimizer = optimizer
        self.last_epoch = 0

    def step(self) -> None:
        self.optimizer.param_groups[0]["lr"] *= 0.5
        self.last_epoch += 1


def backward_once(model: ThreeLayer) -> None:
    """Gradients (6, 3, 2) for weights (1, 2, 3), whatever zero_grad left behind."""
    for p in model.parameters():
        p.grad = None
    model(torch.ones(1, 1, device=model.fc1.weight.device)).sum().backward()


class Wide(nn.Module):
    """A model whose weight (80 KiB) and buffer travel as tensors of their own; the bias is packed.

    ``fill(v)`` sets every parameter and buffer to ``v``; ``values()`` reads the distinct values back.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(128, 160)
        self.register_buffer("stats", torch.zeros(40_000, dtype=torch.float64))

    def fill(self, value: float) -> None:
        with torch.no_grad():
            for tensor in [*self.parameters(), *self.buffers()]:
                tensor.fill_(value)

    def values(self) -> list[list[float]]:
        return [sorted(set(t.flatten().tolist())) for t in [*self.parameters(), *self.buffers()]]


def through_disk(state: dict[str, Any]) -> Any:
    """``state`` after a round trip through ``torch.save`` / ``torch.load`` (as a checkpoint file would)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)
