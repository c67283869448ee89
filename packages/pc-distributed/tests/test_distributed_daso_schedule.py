"""DASO's pure pieces: the skip schedule, the plateau detector, the staleness merge (exact numbers)."""

from __future__ import annotations

import pytest
import torch

from pc_distributed.parallel.daso._schedule import PlateauDetector, SkipState, next_skips, phase_of
from pc_distributed.parallel.daso.daso import DASO, staleness_merge

KW = {
    "warmup_epochs": 2,
    "cooldown_epochs": 2,
    "total_epochs": 12,
    "max_global_skips": 8,
    "skip_reduction_factor": 2,
    "local_skip_factor": 4,
}


def run_schedule(plateaus: list[bool]) -> list[tuple[int, int, int]]:
    state = SkipState(0, 0, 0)
    seq = []
    for epoch, plateau in enumerate(plateaus):
        state = next_skips(state, epoch, plateau, **KW)
        seq.append(tuple(state))
    return seq


def test_daso_schedule_full_cycle() -> None:
    # epochs 0-1 warm-up, 2-9 cycling, 10-11 cool-down
    plateaus = [True, True, False, True, True, True, True, False, True, False, True, False]
    assert run_schedule(plateaus) == [
        (0, 0, 0),  # warm-up ignores plateaus
        (0, 0, 0),
        (8, 1, 1),  # start of cycling: (max, 1, 1)
        (4, 1, 1),  # plateau: gs / 2, ls / 2 (kept >= 1), btw - 1 (kept >= 1)
        (2, 1, 1),
        (1, 1, 1),
        (8, 2, 2),  # plateau at gs == 1: reset to (max, max // 4, max // 4)
        (8, 2, 2),
        (4, 1, 1),
        (4, 1, 1),
        (0, 0, 0),  # cool-down
        (0, 0, 0),
    ]


def test_daso_schedule_plateau_on_first_cycling_epoch_and_no_warmup() -> None:
    assert next_skips(SkipState(0, 0, 0), 2, True, **KW) == SkipState(4, 1, 1)
    kw = {**KW, "warmup_epochs": 0}
    assert next_skips(SkipState(0, 0, 0), 0, False, **kw) == SkipState(8, 1, 1)
    assert next_skips(SkipState(8, 1, 1), 3, False, **{**KW, "max_global_skips": 0}) == SkipState(0, 0, 0)


def test_daso_phases() -> None:
    assert [phase_of(e, 2, 2, 6) for e in range(6)] == ["warmup"] * 2 + ["cycling"] * 2 + ["cooldown"] * 2
    assert phase_of(0, 0, 0, 1) == "cycling"


def test_daso_plateau_detector_counts_relative_improvement() -> None:
    d = PlateauDetector(patience=2, threshold=0.05)
    # 1.0 best; 0.96 is not 5% better; third non-improving epoch triggers, then the count restarts
    assert [d.step(v) for v in [1.0, 0.96, 0.97, 0.99, 0.98, 0.5]] == [
        False,
        False,
        False,
        True,
        False,
        False,
    ]
    assert d.best == 0.5
    d.reset()
    assert d.best == float("inf")
    assert d.num_bad_epochs == 0
    with pytest.raises(ValueError, match="patience"):
        PlateauDetector(patience=-1)
    with pytest.raises(ValueError, match="threshold"):
        PlateauDetector(threshold=1.0)


def test_daso_staleness_merge_hand_computed() -> None:
    local = torch.tensor([1.0, -2.0])
    total = torch.tensor([4.0, 2.0])  # sum over P = 2 nodes of what they sent
    # S = 0: the plain average of the sent values
    assert torch.equal(staleness_merge(local, total, 0, 2), torch.tensor([2.0, 1.0]))
    # S = 1: (2*local + total) / (2 + 2)
    assert torch.equal(staleness_merge(local, total, 1, 2), torch.tensor([1.5, -0.5]))
    # S = 2, P = 4: (4*local + total) / 8
    assert torch.equal(staleness_merge(local, total, 2, 4), torch.tensor([1.0, -0.75]))


def test_daso_needs_initialised_torch_distributed() -> None:
    p = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(RuntimeError, match="not initialised"):
        DASO(torch.optim.SGD([p], lr=0.1), total_epochs=3)
    with pytest.raises(TypeError, match="total_epochs must be an int"):
        DASO(torch.optim.SGD([p], lr=0.1), total_epochs=2.5)  # type: ignore[arg-type]
