"""``ModelSizeEstimator``: memory (and, with example inputs, activations and FLOPs) of one module.

Byte counts are exact: every unique storage of the parameters and buffers counts once with its true element
size, whatever the dtype. Results are in MiB (2**20 bytes), as the API always reported them;
:meth:`requirements` gives the plain byte counts.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from pc_assigner._sizing import MetaTrace, meta_trace, unique_bytes

__all__ = ["MIB", "ModelSizeEstimator", "SizeRequirements"]

MIB = 2**20
"""Bytes per MiB, the unit of the estimator's float results."""


@dataclass(frozen=True)
class SizeRequirements:
    """Byte counts of one module (ints; FLOPs are ``None`` without example inputs).

    Attributes:
        parameters: Unique parameter storage bytes (P).
        buffers: Unique buffer storage bytes not shared with a parameter (B).
        gradients: Bytes of the parameters that require grad (G).
        optimizer_state: ``2 * gradients`` (O, an Adam-like optimizer keeps two moments).
        activations: Output bytes of every leaf module in one forward (A; 0 without example inputs).
        flops: Forward plus backward FLOPs of one step, or ``None`` without example inputs.
    """

    parameters: int
    buffers: int
    gradients: int
    optimizer_state: int
    activations: int
    flops: int | None

    @property
    def training_bytes(self) -> int:
        """``P + B + G + O + A``: what one training step needs besides the allocator's and CUDA's overhead."""
        return self.parameters + self.buffers + self.gradients + self.optimizer_state + self.activations


class ModelSizeEstimator:
    """Size estimator for PyTorch modules (exact for every dtype).

    Args:
        model: Module to be estimated.
        size_multiplier: :meth:`estimate_size` multiplies the parameter and buffer size by this, to reserve
            room for gradients, optimizer state and inputs (a correction coefficient).
        example_inputs: Optional tuple of positional inputs; enables :meth:`estimate_flops`,
            :meth:`estimate_activation_size` and :meth:`estimate_training_size` through a meta-device forward
            (the module itself is never moved or copied).

    Raises:
        TypeError: if ``model`` is not a ``torch.nn.Module``, ``size_multiplier`` not a number or
            ``example_inputs`` not a tuple.
        ValueError: if ``size_multiplier`` is negative or not finite.

    Examples:
        >>> est = ModelSizeEstimator(torch.nn.Linear(3, 4), size_multiplier=1)
        >>> est.get_parameter_sizes() * 2**20  # 12 weights + 4 biases, float32
        64.0
    """

    def __init__(
        self,
        model: torch.nn.Module,
        size_multiplier: float = 2,
        *,
        example_inputs: tuple[Any, ...] | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(size_multiplier, bool) or not isinstance(size_multiplier, (int, float)):
            raise TypeError(f"size_multiplier must be a number, got {type(size_multiplier).__name__}")
        if not math.isfinite(size_multiplier) or size_multiplier < 0:
            raise ValueError(f"size_multiplier must be a finite number >= 0, got {size_multiplier!r}")
        if example_inputs is not None and not isinstance(example_inputs, tuple):
            raise TypeError(
                "example_inputs must be None or a tuple of positional inputs, "
                f"got {type(example_inputs).__name__}"
            )
        self.model = model
        self.size_multiplier = size_multiplier
        self.example_inputs = example_inputs
        self._trace: MetaTrace | None = None

    def parameter_bytes(self) -> int:
        """Bytes of the unique parameter storages."""
        return unique_bytes(self.model.parameters())

    def buffer_bytes(self) -> int:
        """Bytes of the unique buffer storages that no parameter shares."""
        seen: set[Hashable] = set()
        unique_bytes(self.model.parameters(), seen)
        return unique_bytes(self.model.buffers(), seen)

    def get_parameter_sizes(self) -> float:
        """Size of all parameters in MiB (shared storages once)."""
        return self.parameter_bytes() / MIB

    def get_buffer_sizes(self) -> float:
        """Size of all buffers in MiB (storages shared with parameters or other buffers once)."""
        return self.buffer_bytes() / MIB

    def estimate_size(self) -> float:
        """``(parameters + buffers) * size_multiplier`` in MiB, the original API's estimate."""
        return (self.parameter_bytes() + self.buffer_bytes()) * self.size_multiplier / MIB

    def _meta(self) -> MetaTrace:
        if self.example_inputs is None:
            raise ValueError(
                "this needs example_inputs: pass ModelSizeEstimator(model, example_inputs=(x, ...))"
            )
        if self._trace is None:
            self._trace = meta_trace(self.model, self.example_inputs)
        return self._trace

    def estimate_flops(self) -> int:
        """FLOPs of one forward plus backward (of ``out.sum()``) on the example inputs.

        Raises:
            ValueError: without ``example_inputs``.
            RuntimeError: if the module cannot run on the meta device.
        """
        return self._meta().flops

    def estimate_activation_size(self) -> float:
        """Output size of every leaf module in one forward, in MiB.

        Raises:
            ValueError: without ``example_inputs``.
        """
        return self._meta().activation_bytes / MIB

    def requirements(self) -> SizeRequirements:
        """All byte counts; activations and FLOPs only when ``example_inputs`` were given."""
        params = self.parameter_bytes()
        grads = unique_bytes(p for p in self.model.parameters() if p.requires_grad)
        trace = self._meta() if self.example_inputs is not None else None
        return SizeRequirements(
            parameters=params,
            buffers=self.buffer_bytes(),
            gradients=grads,
            optimizer_state=2 * grads,
            activations=trace.activation_bytes if trace else 0,
            flops=trace.flops if trace else None,
        )

    def estimate_training_size(self) -> float:
        """``P + B + G + O + A`` in MiB (see :class:`SizeRequirements`); needs ``example_inputs`` for A.

        Raises:
            ValueError: without ``example_inputs``.
        """
        self._meta()
        return self.requirements().training_bytes / MIB
