"""Model state helpers shared by the model and gradient servers: ``pp_version``, snapshots and loading."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pc_server._checks import integer
from pc_server._packing import Packed, pack, unpack

__all__ = ["check_model", "get_pp_version", "load_snapshot", "model_snapshot", "set_pp_version"]


def check_model(model: object) -> nn.Module:
    """Validate that ``model`` is a ``torch.nn.Module``.

    Raises:
        TypeError: If it is not.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return model


def get_pp_version(model: nn.Module) -> int:
    """The model's ``pp_version`` attribute, 0 when absent.

    Raises:
        TypeError: If ``pp_version`` is set to something other than an int.
    """
    version = getattr(model, "pp_version", 0)
    return integer("model.pp_version", version)


def set_pp_version(model: nn.Module, version: Any) -> None:
    """Set ``model.pp_version`` (a plain attribute)."""
    setattr(model, "pp_version", version)  # noqa: B010 - nn.Module.__setattr__ is typed for tensors and modules


def model_snapshot(model: nn.Module, *, copy: bool = True) -> Packed:
    """A packed CPU copy of ``model.state_dict()`` (parameters and buffers, detached); gradients untouched.

    Args:
        model: The model.
        copy: With ``False`` large CPU tensors are not copied but shared with the model: only for a value that
            is serialised right away (an RPC argument), so that the serialisation is the one copy.

    Returns:
        The packed state.
    """
    with torch.no_grad():
        return pack(model.state_dict(), copy=copy)


def load_snapshot(model: nn.Module, packed: Any) -> None:
    """Load a packed state dict into ``model`` in place.

    ``load_state_dict`` copies into the existing tensors, so parameter identity, device and dtype are kept and
    optimizer state stays valid.

    Raises:
        TypeError: If ``packed`` is not a packed state dict.
        RuntimeError: If the keys or shapes do not match the model (from ``load_state_dict``).
    """
    model.load_state_dict(unpack(packed), strict=True)
