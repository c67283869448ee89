"""``DataParallelOptimizer``: a torch optimizer whose step and zero_grad work with DataParallel."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from pc_distributed._checks import bool_flag

__all__ = ["DataParallelOptimizer"]


class _GradOwner(Protocol):
    """What the optimizer needs from the DataParallel it was given to."""

    def _before_optimizer_step(self) -> None: ...

    def _before_zero_grad(self, update_pending: bool) -> None: ...


class DataParallelOptimizer:
    """Wraps a torch optimizer for :class:`~pc_distributed.DataParallel`.

    In blocking mode :meth:`step` makes sure every gradient reduction has finished and steps the torch
    optimizer at once. In non-blocking mode it only records that a step is due (``update_next``); the wrapped
    module then applies the step layer by layer in its next forward pass, as soon as that layer's averaged
    gradient arrives. The mode is decided by the :class:`~pc_distributed.DataParallel` this optimizer is
    passed to (it overwrites ``blocking_parameter_updates``).

    Args:
        torch_optimizer: The local torch optimizer over the module's parameters.
        blocking: The initial mode; overwritten by ``DataParallel``.

    Raises:
        TypeError: If ``torch_optimizer`` is not a ``torch.optim.Optimizer`` or ``blocking`` is not a bool.

    Examples:
        >>> opt = DataParallelOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))  # doctest: +SKIP
        >>> dp = DataParallel(model, optimizer=opt)  # doctest: +SKIP
    """

    def __init__(self, torch_optimizer: torch.optim.Optimizer, blocking: bool = False) -> None:
        if not isinstance(torch_optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"torch_optimizer must be a torch.optim.Optimizer, got {type(torch_optimizer).__name__}"
            )
        self.torch_optimizer = torch_optimizer
        self.blocking_parameter_updates = bool_flag("blocking", blocking)
        #: Non-blocking mode: a step is due and will be applied layer by layer in the next forward.
        self.update_next = False
        self._owner: _GradOwner | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (for schedulers and learning-rate changes)."""
        return self.torch_optimizer.param_groups

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step now (blocking mode) or at the next forward (non-blocking mode).

        Args:
            closure: Re-evaluates the model and returns the loss; only in blocking mode.

        Returns:
            The closure's loss in blocking mode, else ``None``.

        Raises:
            ValueError: If a closure is given in non-blocking mode.
        """
        if self.blocking_parameter_updates or self._owner is None:
            if self._owner is not None:
                self._owner._before_optimizer_step()
            return self.torch_optimizer.step(closure)
        if closure is not None:
            raise ValueError(
                "a closure needs blocking parameter updates; build DataParallel with "
                "blocking_parameter_updates=True"
            )
        self._owner._before_optimizer_step()
        self.update_next = True
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of the wrapped optimizer's parameters.

        Reductions still in flight from a backward pass that was not followed by :meth:`step` are completed
        (so every rank issues the same collectives) and their results dropped.

        Args:
            set_to_none: Set gradients to ``None`` instead of zeroing them (torch's default).
        """
        if self._owner is not None:
            self._owner._before_zero_grad(self.update_next)
        self.torch_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict."""
        return self.torch_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped optimizer's state dict.

        Args:
            state_dict: As returned by :meth:`state_dict`.
        """
        self.torch_optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        mode = "blocking" if self.blocking_parameter_updates else "non-blocking"
        return f"DataParallelOptimizer({type(self.torch_optimizer).__name__}, {mode})"
