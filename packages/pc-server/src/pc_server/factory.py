"""Helpers that build model and gradient servers on every member of a world and hand back accessors.

Every world process enters the helper (the RpcGroup is created by its members). The first member in sorted
order hosts the servers, so every process agrees on the host without communicating.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pc_server._checks import positive_int
from pc_server.grad.client import PushPullGradServer
from pc_server.grad.config import GradServerConfig
from pc_server.grad.server import STOP_TIMEOUT_S, PushPullGradServerImpl
from pc_server.model_server import PushPullModelServer, PushPullModelServerImpl

__all__ = ["ServerTuple", "grad_server_helper", "model_server_helper"]

logger = logging.getLogger(__name__)


class ServerTuple(tuple):  # type: ignore[type-arg]
    """The tuple of accessors a helper returns, plus the Impls this process hosts.

    It is a plain tuple of accessors (index it, unpack it); :attr:`impls` keeps the hosted servers alive and
    :meth:`stop` stops the gradient reducers among them. Safe to share between threads (the Impls are).
    """

    impls: tuple[Any, ...]

    def __new__(cls, accessors: Sequence[Any], impls: Sequence[Any]) -> ServerTuple:  # noqa: D102
        obj = super().__new__(cls, tuple(accessors))
        obj.impls = tuple(impls)
        return obj

    def __reduce__(self) -> Any:  # pickles as a plain tuple of accessors
        return (tuple, (tuple(self),))

    def watch(self) -> None:
        """Re-raise the first error of a hosted gradient reducer (see ``PushPullGradServerImpl.watch``)."""
        for impl in self.impls:
            if isinstance(impl, PushPullGradServerImpl):
                impl.watch()

    def stop(self, timeout: float | None = STOP_TIMEOUT_S) -> None:
        """Stop every hosted gradient reducer (idempotent); model servers need no stopping.

        Args:
            timeout: Seconds to wait for each reducer thread (see ``PushPullGradServerImpl.stop``).
        """
        for impl in self.impls:
            if isinstance(impl, PushPullGradServerImpl):
                impl.stop(timeout)


def _members(world: Any, members: str | Sequence[str]) -> list[str]:
    if members == "all":
        return sorted(world.get_members())
    if isinstance(members, str) or not isinstance(members, Sequence) or not members:
        raise ValueError(f"members must be 'all' or a non-empty list of process names, got {members!r}")
    return sorted(members)


def _world() -> Any:
    from pc_distributed import get_world

    world = get_world()
    if world is None:
        raise RuntimeError("no pc_distributed World in this process: create one (or use run_world) first")
    return world


def model_server_helper(
    model_num: int,
    group_name: str = "model_server",
    members: str | Sequence[str] = "all",
    *,
    timeout: float | None = None,
) -> ServerTuple:
    """Create ``model_num`` model servers (``model_server_0``, ...) on the first member; return accessors.

    Every process of the world calls it. Members create the RpcGroup ``group_name``; the first member (sorted)
    hosts the servers; then all members meet at a barrier and fetch the accessors.

    Args:
        model_num: How many models (one server each).
        group_name: Name of the RpcGroup to create.
        members: ``"all"`` or the process names taking part.
        timeout: Seconds for the members' barrier (``None``: the group's default).

    Returns:
        A :class:`ServerTuple` of :class:`~pc_server.PushPullModelServer` accessors; empty on non-members.

    Raises:
        TypeError: ``model_num`` is not an int.
        ValueError: ``model_num < 1`` or bad ``members``.
        RuntimeError: No World in this process.
    """
    positive_int("model_num", model_num)
    world = _world()
    names = _members(world, members)
    if world.name not in names:
        return ServerTuple((), ())
    group = world.create_rpc_group(group_name, names)
    impls: list[Any] = []
    if group.get_cur_name() == names[0]:
        impls = [PushPullModelServerImpl(f"model_server_{i}", group) for i in range(model_num)]
    group.barrier(timeout)
    accessors: list[PushPullModelServer] = [
        group.get_paired(f"model_server_{i}").to_here() for i in range(model_num)
    ]
    return ServerTuple(accessors, impls)


def grad_server_helper(
    model_creators: Sequence[Callable[[], nn.Module]],
    group_name: str = "grad_server",
    members: str | Sequence[str] = "all",
    optimizer: Callable[..., Any] = torch.optim.Adam,
    learning_rate: float = 1e-3,
    optimizer_kwargs: dict[str, Any] | None = None,
    lr_scheduler: Callable[..., Any] | None = None,
    lr_scheduler_args: tuple[Any, ...] | None = None,
    lr_scheduler_kwargs: dict[str, Any] | None = None,
    *,
    timeout: float | None = None,
    server_kwargs: dict[str, Any] | None = None,
) -> ServerTuple:
    """Create one gradient server per model creator (``grad_server_0``, ...) and start every reducer.

    Every process of the world calls it. The first member (sorted) is the primary reducer of every server and
    manages a model made by the creator, with ``optimizer(model.parameters(), lr=learning_rate,
    **optimizer_kwargs)`` and, if given, ``lr_scheduler(optimizer, *lr_scheduler_args,
    **lr_scheduler_kwargs)``; every member is a secondary reducer, and **every** reducer is started (a
    secondary that is not started would strand the gradients sent to it).

    Args:
        model_creators: Callables returning the managed models.
        group_name: Name of the RpcGroup to create.
        members: ``"all"`` or the process names taking part.
        optimizer: Optimizer class (or factory).
        learning_rate: Its learning rate.
        optimizer_kwargs: Extra optimizer keyword arguments.
        lr_scheduler: Optional scheduler class (or factory).
        lr_scheduler_args: Its positional arguments after the optimizer.
        lr_scheduler_kwargs: Its keyword arguments.
        timeout: Seconds for the members' barrier, which waits for the primary to build the models and
            optimizers (``None``: the group's default).
        server_kwargs: Settings of every server, as :meth:`~pc_server.GradServerConfig.build` takes them,
            plus an ``o_server`` accessor, e.g. ``{"reduce_method": "mean", "reduce_batch_size": 1,
            "max_staleness": 4}``.

    Returns:
        A :class:`ServerTuple` of :class:`~pc_server.PushPullGradServer` accessors (empty on non-members);
        call ``.stop()`` on it before stopping the world.

    Raises:
        ValueError: No model creators or bad ``members``.
        TypeError: A creator or factory is not callable.
        RuntimeError: No World in this process.
    """
    if not isinstance(model_creators, (list, tuple)) or not model_creators:
        raise ValueError(f"model_creators must be a non-empty list of callables, got {model_creators!r}")
    for creator in model_creators:
        if not callable(creator):
            raise TypeError(f"model creators must be callable, got {type(creator).__name__}")
    if not callable(optimizer) or (lr_scheduler is not None and not callable(lr_scheduler)):
        raise TypeError("optimizer and lr_scheduler must be callables (classes or factories)")
    world = _world()
    names = _members(world, members)
    if world.name not in names:
        return ServerTuple((), ())
    group = world.create_rpc_group(group_name, names)
    primary = names[0]
    settings = dict(server_kwargs or {})
    o_server = settings.pop("o_server", None)
    impls: list[PushPullGradServerImpl] = []
    for i, creator in enumerate(model_creators):
        config = GradServerConfig.build(
            group, f"grad_server_{i}", primary_reducer=primary, secondary_reducers=names, **settings
        )
        impl = PushPullGradServerImpl.from_config(group, config, o_server)
        if group.get_cur_name() == primary:
            model = creator()
            opt = optimizer(model.parameters(), lr=learning_rate, **(optimizer_kwargs or {}))
            sched = None
            if lr_scheduler is not None:
                sched = lr_scheduler(opt, *(lr_scheduler_args or ()), **(lr_scheduler_kwargs or {}))
            impl.manage_model(model, opt, sched)
        impl.start()
        impls.append(impl)
    group.barrier(timeout)
    accessors: list[PushPullGradServer] = [
        group.get_paired(f"grad_server_{i}").to_here() for i in range(len(model_creators))
    ]
    return ServerTuple(accessors, impls)
