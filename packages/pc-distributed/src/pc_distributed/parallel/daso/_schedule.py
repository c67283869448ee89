"""DASO's skip schedule and plateau detector as small pure pieces (no communication, no torch state).

The schedule decides, at the end of each epoch, three numbers for the next one:

* ``global_skip`` (gs): batches between the starts of two global (cross-node) synchronisations; 0 = every
  batch, blocking;
* ``local_skip`` (ls): batches between node-local gradient synchronisations; 0 or 1 = every batch;
* ``batches_to_wait`` (btw): batches between sending parameters and merging what came back; 0 = blocking.

Phases: warm-up ``(0, 0, 0)``; then ``(max_global_skips, 1, 1)``; on a loss plateau with gs > 1 every value is
divided by ``skip_reduction_factor`` (btw decreases by one), each kept >= 1; on a plateau at gs == 1 the cycle
restarts at ``(max, max // local_skip_factor, max // local_skip_factor)``; cool-down ``(0, 0, 0)``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = ["PlateauDetector", "SkipState", "next_skips", "phase_of"]


class SkipState(NamedTuple):
    """The three schedule values of one epoch."""

    global_skip: int
    local_skip: int
    batches_to_wait: int


def phase_of(epoch: int, warmup_epochs: int, cooldown_epochs: int, total_epochs: int) -> str:
    """``"warmup"``, ``"cycling"`` or ``"cooldown"`` for a 0-based epoch.

    Args:
        epoch: The epoch about to start (0-based).
        warmup_epochs: Epochs of blocking synchronisation at the start.
        cooldown_epochs: Epochs of blocking synchronisation at the end.
        total_epochs: All epochs.

    Returns:
        The phase name.

    Examples:
        >>> [phase_of(e, 2, 1, 5) for e in range(5)]
        ['warmup', 'warmup', 'cycling', 'cycling', 'cooldown']
    """
    if epoch < warmup_epochs:
        return "warmup"
    if epoch >= total_epochs - cooldown_epochs:
        return "cooldown"
    return "cycling"


def next_skips(
    current: SkipState,
    epoch: int,
    plateaued: bool,
    *,
    warmup_epochs: int,
    cooldown_epochs: int,
    total_epochs: int,
    max_global_skips: int,
    skip_reduction_factor: int,
    local_skip_factor: int,
) -> SkipState:
    """The schedule values for ``epoch`` (0-based, the epoch about to start).

    Args:
        current: The values used in the epoch that just ended.
        epoch: The epoch about to start.
        plateaued: Whether the loss stopped improving (see :class:`PlateauDetector`).
        warmup_epochs: Epochs of blocking synchronisation at the start.
        cooldown_epochs: Epochs of blocking synchronisation at the end.
        total_epochs: All epochs.
        max_global_skips: The largest global skip.
        skip_reduction_factor: Divisor applied to the skips on a plateau.
        local_skip_factor: ``max_global_skips // local_skip_factor`` is the local skip and wait after a reset.

    Returns:
        The new values.

    Examples:
        >>> kw = dict(warmup_epochs=1, cooldown_epochs=1, total_epochs=9, max_global_skips=8,
        ...           skip_reduction_factor=2, local_skip_factor=4)
        >>> next_skips(SkipState(0, 0, 0), 1, False, **kw)
        SkipState(global_skip=8, local_skip=1, batches_to_wait=1)
        >>> next_skips(SkipState(8, 1, 1), 2, True, **kw)
        SkipState(global_skip=4, local_skip=1, batches_to_wait=1)
    """
    phase = phase_of(epoch, warmup_epochs, cooldown_epochs, total_epochs)
    if phase != "cycling" or max_global_skips == 0:
        return SkipState(0, 0, 0)
    gs, ls, btw = current
    if gs == 0:  # first cycling epoch (or after a blocking phase): start the cycle
        gs, ls, btw = max_global_skips, 1, 1
    if plateaued and gs > 1:
        gs = max(gs // skip_reduction_factor, 1)
        ls = max(ls // skip_reduction_factor, 1)
        btw = max(btw - 1, 1)
    elif plateaued and gs == 1:
        gs = max_global_skips
        ls = max(max_global_skips // local_skip_factor, 1)
        btw = ls
    return SkipState(gs, ls, btw)


class PlateauDetector:
    """Says when a minimised metric stopped improving by a relative ``threshold`` for > ``patience`` epochs.

    The rule of ``torch.optim.lr_scheduler.ReduceLROnPlateau`` (mode ``min``, relative threshold): a
    value improves if it is below ``best * (1 - threshold)``.

    Args:
        patience: Epochs without improvement that are tolerated.
        threshold: The relative improvement that counts (``stability_level`` in DASO).

    Raises:
        ValueError: If ``patience < 0`` or ``threshold`` is outside ``[0, 1)``.

    Examples:
        >>> d = PlateauDetector(patience=1, threshold=0.1)
        >>> [d.step(v) for v in [10.0, 9.5, 9.4, 8.0]]
        [False, False, True, False]
    """

    def __init__(self, patience: int = 2, threshold: float = 0.05) -> None:
        if patience < 0:
            raise ValueError(f"patience must be >= 0, got {patience}")
        if not 0.0 <= threshold < 1.0:
            raise ValueError(f"threshold must be in [0, 1), got {threshold}")
        self.patience = patience
        self.threshold = threshold
        self.reset()

    def reset(self) -> None:
        """Forget the history."""
        self.best = math.inf
        self.num_bad_epochs = 0

    def step(self, value: float) -> bool:
        """Record one epoch's metric; return ``True`` when a plateau is detected (the count then restarts).

        Args:
            value: The epoch's metric (e.g. the globally averaged loss).

        Returns:
            Whether the metric has plateaued.
        """
        if value < self.best * (1.0 - self.threshold):
            self.best = value
            self.num_bad_epochs = 0
            return False
        self.num_bad_epochs += 1
        if self.num_bad_epochs > self.patience:
            self.num_bad_epochs = 0
            return True
        return False
