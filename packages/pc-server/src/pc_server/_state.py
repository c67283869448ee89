"""A model's state as both servers see it: ``pp_version``, snapshots, loading, publishing it.

:func:`push_model` and :func:`pull_model` are the model server's two calls; the gradient client pulls with the
second, so both live here rather than in either server's module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pc_server._checks import integer
from pc_server._packing import Packed, pack, unpack
from pc_server._versioned import is_newer
from pc_server.ordered_server import OrderedServerBase, OrderedServerSimple

__all__ = [
    "check_model",
    "get_pp_version",
    "load_snapshot",
    "model_snapshot",
    "pull_model",
    "push_model",
    "set_pp_version",
]


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


def push_model(o_server: OrderedServerBase, model_name: str, model: nn.Module, pull_on_fail: bool) -> bool:
    """Compare-and-set push of ``model``'s state at ``pp_version + 1`` (see :meth:`PushPullModelServer.push`).

    Args:
        o_server: The ordered server accessor.
        model_name: The key.
        model: The model.
        pull_on_fail: Load the newest state and adopt its version when refused.

    Returns:
        Whether the push was accepted.
    """
    pp = get_pp_version(model)
    newest: tuple[Any, Any] | None
    if isinstance(o_server, OrderedServerSimple):
        # The RPC serialises the tensors (also to the serving process itself) and the server keeps what it
        # received, so large tensors travel without a client-side copy: the server's copy is the only one.
        state = model_snapshot(model, copy=False)
        result = o_server.push_service_call(model_name, state, pp + 1, pp, want_newest=pull_on_fail)
        accepted, newest = result.accepted, result.newest
    else:  # an unknown server may keep the value as given: hand it a private copy
        accepted = o_server.push(model_name, model_snapshot(model), pp + 1, pp)
        newest = o_server.pull(model_name) if (not accepted and pull_on_fail) else None
    if accepted:
        set_pp_version(model, pp + 1)
        return True
    if newest is not None:
        load_snapshot(model, newest[0])
        set_pp_version(model, newest[1])
    return False


def pull_model(
    o_server: OrderedServerBase, model_name: str, model: nn.Module, *, exact: bool = False
) -> bool:
    """Load the newest state of ``model_name`` into ``model`` if it is newer than ``model.pp_version``.

    Args:
        o_server: The ordered server accessor.
        model_name: The key.
        model: The model.
        exact: Load the server's state whenever its version differs from ``model.pp_version``, also when the
            model's is ahead (the gradient client: its gradients must be computed on the server's model).

    Returns:
        ``False`` if the server holds no model yet, else ``True``.
    """
    known = getattr(model, "pp_version", None)
    if known is not None:
        known = get_pp_version(model)
    found: tuple[Any, Any] | None
    if isinstance(o_server, OrderedServerSimple):
        reply = o_server.pull_if_newer(model_name, known)
        if reply is None:
            return False
        if reply.fresh:
            found = (reply.value, reply.version)
        elif exact and reply.version != known:  # the model is ahead: a second call brings the server's state
            found = o_server.pull(model_name)
        else:
            return True
    else:
        found = o_server.pull(model_name)
    if found is None:
        return False
    state, version = found
    if is_newer(version, known) or (exact and version != known):
        load_snapshot(model, state)
        set_pp_version(model, version)
    return True
