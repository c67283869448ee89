"""ElasticSampler: which samples each member trains on in a step, as a pure function of (step, quorum).

A run of ``num_samples`` samples is cut into epochs of ``steps_per_epoch = num_samples // batch_size`` steps.
Epoch ``e`` visits the samples in one seeded permutation (a function of ``seed`` and ``e`` only); step ``s``
(counted from the start of training, as :attr:`ElasticDataParallel.step` counts committed steps) trains on
the ``batch_size`` samples at positions ``[k * batch_size, (k + 1) * batch_size)`` of its epoch's
permutation, ``k = s % steps_per_epoch``. That global batch is split among the step's members, sorted by
name, in contiguous runs whose lengths differ by at most one (the first members get the longer runs).

Because the global batch depends on the step alone, a step that is re-run (its reduction failed) or run by
other members (one died, one joined) trains on exactly the same samples: within an epoch no sample is
trained twice or skipped. The last ``num_samples % batch_size`` samples of each epoch's permutation are not
trained in that epoch (they fall elsewhere in the next epoch's permutation).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from pc_distributed._checks import int_at_least, non_negative_int

__all__ = ["ElasticSampler"]


class ElasticSampler:
    """Sample indices per step and member, a pure function of (seed, step, members).

    Args:
        num_samples: Size of the data set (>= ``batch_size``).
        batch_size: Global batch per step, split across the step's members (>= 1).
        seed: Seed of the per-epoch permutations; every member must use the same.

    Raises:
        TypeError: If an argument is not an integer.
        ValueError: If ``batch_size < 1`` or ``num_samples < batch_size``.

    Examples:
        >>> s = ElasticSampler(10, 4, seed=0)
        >>> sorted(s.indices(0, ["a", "b", "c"], "a") + s.indices(0, ["a", "b", "c"], "b")
        ...        + s.indices(0, ["a", "b", "c"], "c")) == sorted(s.batch(0))
        True
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int = 0) -> None:
        self.batch_size = int_at_least("batch_size", batch_size, 1)
        self.num_samples = int_at_least("num_samples", num_samples, self.batch_size)
        self.seed = non_negative_int("seed", seed)
        self.steps_per_epoch = self.num_samples // self.batch_size

    def epoch_of(self, step: int) -> int:
        """The epoch that step ``step`` (>= 0) belongs to."""
        return non_negative_int("step", step) // self.steps_per_epoch

    def permutation(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s order of the samples (seeded by ``seed`` and ``epoch`` only)."""
        order = list(range(self.num_samples))
        random.Random(f"pc-elastic/{self.seed}/{non_negative_int('epoch', epoch)}").shuffle(order)
        return order

    def batch(self, step: int) -> list[int]:
        """The global batch of step ``step``: ``batch_size`` indices, the same whoever trains it."""
        k = non_negative_int("step", step) % self.steps_per_epoch
        return self.permutation(self.epoch_of(step))[k * self.batch_size : (k + 1) * self.batch_size]

    def indices(self, step: int, members: Sequence[str], member: str) -> list[int]:
        """The part of step ``step``'s global batch that ``member`` trains when ``members`` train the step.

        Raises:
            ValueError: If ``member`` is not one of ``members`` or ``members`` has duplicates.
        """
        ordered = sorted(members)
        if len(set(ordered)) != len(ordered):
            raise ValueError(f"members must be distinct, got {list(members)}")
        if member not in ordered:
            raise ValueError(f"member {member!r} is not one of the step's members {ordered}")
        i, n = ordered.index(member), len(ordered)
        base, extra = divmod(self.batch_size, n)
        start = i * base + min(i, extra)
        return self.batch(step)[start : start + base + (1 if i < extra else 0)]

    def __repr__(self) -> str:
        return (
            f"ElasticSampler(num_samples={self.num_samples}, batch_size={self.batch_size}, seed={self.seed})"
        )
