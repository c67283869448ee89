"""Whether a checkpoint fits the gradient server's managed objects, decided before anything is loaded.

``load_state_dict`` of a model, an optimizer or a scheduler changes its object as it goes, and some accept
state that fails only later (torch's ``Adam.load_state_dict`` takes an SGD state dict, and the first step
then dies on the missing ``betas``). So every part of a checkpoint is checked here against the managed
objects first, and the message names what does not fit; only a checkpoint that fits whole is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["check_loadable", "check_model_state", "type_name"]


def type_name(obj: Any) -> str | None:
    """``module.QualName`` of ``obj``'s type (recorded in a checkpoint), ``None`` for ``None``."""
    if obj is None:
        return None
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def check_model_state(model: nn.Module, state: object) -> None:
    """Check that ``state`` has exactly ``model``'s state-dict keys, each a tensor of the same shape.

    Raises:
        ValueError: A missing or unknown key, a value that is not a tensor, or another shape (named).
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"the checkpoint's model state must be a state dict, got {type(state).__name__}")
    mine = model.state_dict()
    missing, unknown = sorted(mine.keys() - state.keys()), sorted(state.keys() - mine.keys())
    if missing or unknown:
        raise ValueError(
            "the checkpoint's model state does not fit the managed model: "
            f"missing {missing}, unknown {unknown}"
        )
    for key, tensor in mine.items():
        value = state[key]
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"the checkpoint's model entry {key!r} is a {type(value).__name__}, not a tensor"
            )
        if value.shape != tensor.shape:
            raise ValueError(
                f"the checkpoint's model entry {key!r} has shape {tuple(value.shape)}, "
                f"the managed model's {tuple(tensor.shape)}"
            )


def check_loadable(what: str, obj: Any, state: Any, recorded_type: object) -> None:
    """Check that ``obj`` (the managed optimizer or lr scheduler) can take ``state`` whole.

    Args:
        what: ``"optimizer"`` or ``"lr_scheduler"``, for the messages.
        obj: The managed object (``None`` when there is none).
        state: The checkpoint's state dict for it (``None`` when the writer's had none).
        recorded_type: The writer's :func:`type_name` of its object (absent in older checkpoints: ``None``).

    Raises:
        TypeError: The checkpoint's object was of another type, or state is given for an object that cannot
            load it.
        ValueError: State is missing, or its keys (for an optimizer: its parameter groups, their sizes and
            hyper-parameter names) differ from the managed object's, named in the message.
    """
    loader = getattr(obj, "load_state_dict", None)
    if state is None:
        if callable(loader):
            raise ValueError(f"the checkpoint holds no {what} state but the managed {what} has one")
        return
    if not callable(loader):
        raise TypeError(f"the checkpoint holds {what} state but the managed {what} cannot load_state_dict()")
    mine_type = type_name(obj)
    if recorded_type is not None and recorded_type != mine_type:
        raise TypeError(f"the checkpoint's {what} is a {recorded_type}, the managed {what} a {mine_type}")
    if not isinstance(state, Mapping):
        raise ValueError(f"the checkpoint's {what} state must be a dict, got {type(state).__name__}")
    mine = obj.state_dict()
    if not isinstance(mine, Mapping):
        return  # an object of the user's with a state of its own kind: its loader judges it
    _same_keys(f"the checkpoint's {what} state", state, mine)
    if "param_groups" in mine:
        _same_groups(what, state["param_groups"], mine["param_groups"])


def _same_keys(what: str, state: Mapping[Any, Any], mine: Mapping[Any, Any]) -> None:
    missing, unknown = (
        sorted(map(str, mine.keys() - state.keys())),
        sorted(map(str, state.keys() - mine.keys())),
    )
    if missing or unknown:
        raise ValueError(f"{what} does not fit: missing keys {missing}, unknown keys {unknown}")


def _same_groups(what: str, groups: object, mine: list[dict[str, Any]]) -> None:
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, Mapping) for g in groups):
        raise ValueError(f"the checkpoint's {what} param_groups must be a list of dicts, got {groups!r:.200}")
    if len(groups) != len(mine):
        raise ValueError(
            f"the checkpoint's {what} has {len(groups)} parameter groups, the managed {what} {len(mine)}"
        )
    for i, (group, own) in enumerate(zip(groups, mine, strict=True)):
        _same_keys(f"the checkpoint's {what} parameter group {i} (hyper-parameters)", group, own)
        params = group["params"]
        if not isinstance(params, (list, tuple)) or len(params) != len(own["params"]):
            raise ValueError(
                f"the checkpoint's {what} parameter group {i} holds {params!r:.100} parameters, the managed "
                f"{what}'s {len(own['params'])}"
            )
