"""Errors of pc-assigner; each subclasses the closest standard exception so existing handlers keep working."""

from __future__ import annotations

__all__ = ["InfeasiblePlacementError"]


class InfeasiblePlacementError(RuntimeError):
    """No placement keeps every device within its memory limit (or none was found, see ``proven``).

    A ``RuntimeError`` subclass, so ``except RuntimeError`` in existing code keeps working.

    Attributes:
        proven: ``True`` when infeasibility was proven (total demand above total capacity, an item larger
            than every device, or an exhaustive/ILP proof); ``False`` when the heuristics found nothing and no
            exact solver could decide.
    """

    def __init__(self, message: str, *, proven: bool = True) -> None:
        super().__init__(message)
        self.proven = proven
