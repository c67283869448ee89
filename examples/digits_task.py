"""The demo's task: scikit-learn's handwritten digits, a small CNN with batch norm, and how it is scored.

The data ships inside scikit-learn (``load_digits``: 1,797 8x8 images of the digits 0-9); nothing is
downloaded. A fixed, seeded split keeps 1,437 images for training and 360 held out.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "NUM_CLASSES",
    "TRAIN_SIZE",
    "Data",
    "batch_of",
    "batch_stat_accuracy",
    "evaluate",
    "load_data",
    "make_model",
    "recompute_bn_stats",
]

Data = tuple[torch.Tensor, torch.Tensor]
NUM_CLASSES = 10
TRAIN_SIZE = 1437  # of load_digits' 1,797 images; the other 360 are held out


def load_data(seed: int) -> tuple[Data, Data]:
    """scikit-learn's handwritten digits as ``(N, 1, 8, 8)`` floats in [0, 1]; a fixed (seeded) split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    train, held_out = order[:TRAIN_SIZE], order[TRAIN_SIZE:]
    return (x[train], y[train]), (x[held_out], y[held_out])


def make_model() -> nn.Module:
    """A small CNN with batch norm: features (two conv + BN + ReLU, a max-pool) then a head (MLP with BN)."""
    return nn.Sequential(
        nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
        ),
        nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, NUM_CLASSES)
        ),
    )


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """``(cross-entropy, accuracy)`` of the model in eval mode on a held-out set."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(x)
    model.train(was_training)
    return nn.functional.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def batch_stat_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Accuracy with batch statistics over the held-out set, for the curves only (a gradient server moves
    gradients, not buffers: the final numbers use :func:`recompute_bn_stats` instead)."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    model.load_state_dict(state)  # the forward in train mode touched the running statistics
    return accuracy


def batch_of(
    x: torch.Tensor, y: torch.Tensor, index: int, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The index-th batch of a fixed shuffled order (deterministic; what the pool's lambda computes)."""
    g = torch.Generator().manual_seed(1000 + index)
    idx = torch.randint(0, x.shape[0], (batch_size,), generator=g)
    return x[idx], y[idx]


def recompute_bn_stats(model: nn.Module, train: Data, batch_size: int) -> None:
    """Reset batch-norm running statistics and re-estimate them as a cumulative average over 20 batches."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None  # cumulative moving average
    model.train()
    with torch.no_grad():
        for i in range(20):
            model(batch_of(*train, i, batch_size)[0])
    for bn in bns:
        bn.momentum = 0.1
