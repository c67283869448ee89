"""The push/pull model server: whole models versioned by ``model.pp_version`` on an ordered server.

::

    client                                   serving process
    ------                                   ---------------
    push(model): pack state dict  --1 RPC-->  CAS(version=pp+1, prev=pp); refused -> newest state in the reply
    pull(model): send pp_version  --1 RPC-->  newest state only if newer than pp_version

Both calls load into the existing tensors (device, dtype and parameter identity are kept) and never touch
gradients. With a custom ``o_server`` that is not an :class:`~pc_server.OrderedServerSimple`, a refused push
with ``pull_on_fail`` costs a second call and every pull transfers the state.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from pc_server._checkpoint import check_state, header
from pc_server._group import GroupLike, check_group, check_name
from pc_server._state import (
    check_model,
    pull_model,
    push_model,
)
from pc_server.ordered_server import OrderedServerBase, OrderedServerSimpleImpl

__all__ = ["PushPullModelServer", "PushPullModelServerImpl"]

logger = logging.getLogger(__name__)


_MODEL_FORMAT = "pc_server.PushPullModelServerImpl"


def _check_o_server(o_server: object) -> OrderedServerBase:
    if not isinstance(o_server, OrderedServerBase):
        raise TypeError(f"o_server must be an OrderedServerBase accessor, got {type(o_server).__name__}")
    return o_server


class PushPullModelServer:
    """Accessor to a :class:`PushPullModelServerImpl`: push and pull whole models by ``pp_version``.

    Get it with ``group.get_paired(server_name).to_here()``; it is picklable. Safe to share between threads
    (it holds no state of its own); a model given to :meth:`push` or :meth:`pull` must not be used by another
    thread meanwhile.

    Args:
        model_name: The model's key in the ordered server.
        o_server: The ordered server accessor (the Impl passes its own).

    Examples:
        >>> server = group.get_paired("model_server").to_here()  # doctest: +SKIP
        >>> if not server.push(model):  # refused: model now holds the newest state  # doctest: +SKIP
        ...     pass
    """

    def __init__(self, model_name: str, o_server: OrderedServerBase | None = None) -> None:
        self.model_name = check_name("model_name", model_name)
        if o_server is None:
            raise TypeError(
                "o_server is required: get the accessor from the Impl with group.get_paired(name)"
            )
        self.o_server = _check_o_server(o_server)

    def __repr__(self) -> str:
        return f"PushPullModelServer(model_name={self.model_name!r}, o_server={self.o_server!r})"

    def push(self, model: nn.Module, pull_on_fail: bool = True) -> bool:
        """Push ``model``'s parameters and buffers as version ``pp_version + 1`` (compare-and-set).

        On success ``model.pp_version`` is incremented. If another client pushed first, the push is refused;
        with ``pull_on_fail`` the newest state arrives in the same reply, is loaded into ``model`` and its
        version adopted. Gradients are never touched.

        Args:
            model: The model (``pp_version`` is 0 when absent).
            pull_on_fail: Load the newest model when the push is refused.

        Returns:
            ``True`` if the push succeeded, else ``False``.

        Raises:
            TypeError: ``model`` is not a module or ``pp_version`` is not an int.
            ConnectionError: The server is unreachable.
            TimeoutError: It did not answer within the RPC timeout.
        """
        return push_model(self.o_server, self.model_name, check_model(model), bool(pull_on_fail))

    def pull(self, model: nn.Module) -> bool:
        """Load the newest model if it is newer than ``model.pp_version`` (or ``pp_version`` is absent).

        An up-to-date model costs one round trip and no state transfer. Gradients are not cleared.

        Args:
            model: The model.

        Returns:
            ``False`` if the server has no model yet, else ``True``.

        Raises:
            TypeError: ``model`` is not a module.
            ConnectionError: The server is unreachable.
            TimeoutError: It did not answer within the RPC timeout.
        """
        return pull_model(self.o_server, self.model_name, check_model(model))


class PushPullModelServerImpl:
    """A model server keeping a strictly ordered version chain of one model.

    Create it on the serving process only, a member of ``group``. Unless ``o_server`` is given it hosts an
    :class:`OrderedServerSimpleImpl` named ``server_name + "_o_server"``; it pairs a
    :class:`PushPullModelServer` accessor under ``server_name``. Safe to share between threads (its hosted
    ordered server is).

    Args:
        server_name: Name of this server, used to pair the accessor in ``group``.
        group: The RpcGroup where the server lives.
        model_name: The model's key in the ordered server.
        o_server: A custom ordered server accessor (then nothing is hosted here).

    Raises:
        TypeError: Wrong argument types.
        ValueError: Empty names.
    """

    def __init__(
        self,
        server_name: str,
        group: GroupLike,
        model_name: str = "model",
        o_server: OrderedServerBase | None = None,
    ) -> None:
        self.server_name = check_name("server_name", server_name)
        self.group = check_group(group)
        self.model_name = check_name("model_name", model_name)
        self._o_server_impl: OrderedServerSimpleImpl | None = None
        if o_server is None:
            self._o_server_impl = OrderedServerSimpleImpl(server_name + "_o_server", group)
            o_server = self._o_server_impl.accessor()  # built locally: no RPC to ourselves
        self.o_server = _check_o_server(o_server)
        group.pair(server_name, PushPullModelServer(self.model_name, self.o_server))
        logger.debug("model server %r serving on %r", server_name, group.get_cur_name())

    @property
    def o_server_impl(self) -> OrderedServerSimpleImpl | None:
        """The ordered server hosted in this process, or ``None`` with a custom ``o_server``."""
        return self._o_server_impl

    def state_dict(self) -> dict[str, Any]:
        """A checkpoint of the hosted ordered server: the model's retained versions, for ``torch.save``.

        Returns:
            ``{"format", "format_version", "model_name", "o_server"}`` (the ordered server's state dict).

        Raises:
            RuntimeError: The ordered server is not hosted here (a custom ``o_server``): checkpoint that one.
        """
        hosted = self._hosted().state_dict()
        return {**header(_MODEL_FORMAT), "model_name": self.model_name, "o_server": hosted}

    def load_state_dict(self, state: Any) -> None:
        """Restore a checkpoint from :meth:`state_dict`: clients then pull the checkpoint's newest version.

        Well defined while serving (the ordered server swaps its content in one step); a client whose
        ``pp_version`` is newer than the restored head keeps its model until it pushes and is refused.

        Args:
            state: The checkpoint.

        Raises:
            TypeError: ``state`` is not a dict.
            ValueError: Another server's checkpoint, another model name, or a malformed entry (named).
            RuntimeError: The ordered server is not hosted here.
        """
        state = check_state(state, _MODEL_FORMAT, ("model_name", "o_server"))
        if state["model_name"] != self.model_name:
            raise ValueError(
                f"model server state_dict holds model {state['model_name']!r}, this server manages "
                f"{self.model_name!r}"
            )
        self._hosted().load_state_dict(state["o_server"])

    def _hosted(self) -> OrderedServerSimpleImpl:
        if self._o_server_impl is None:
            raise RuntimeError(
                f"model server {self.server_name!r} uses a custom o_server {self.o_server!r}; "
                "checkpoint that server instead"
            )
        return self._o_server_impl
