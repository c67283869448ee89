"""The gradient server's settings: validated once, frozen, shared by the primary and secondary reducers."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from pc_server._checks import optional_non_negative_int, optional_positive_seconds, positive_int
from pc_server._group import GroupLike, check_name
from pc_server.grad._reduce import check_reduce_method

__all__ = ["GradServerConfig"]


@dataclasses.dataclass(frozen=True)
class GradServerConfig:
    """The validated settings of one gradient server as seen from one reducer process.

    Build it with :meth:`build`; :class:`~pc_server.PushPullGradServerImpl` does, and keeps it as ``config``.

    Attributes:
        server_name: The server's name (pairs the accessor, names the services).
        model_name: The model's key in the ordered server.
        me: This process's member name.
        primary_reducer: The member that steps the optimizer.
        secondary_reducers: The members clients push to, in rotation order.
        reduce_method: ``"sum"`` or ``"mean"``.
        reduce_device: Where reductions run.
        reduce_batch_size: Items per reduction batch, at both levels.
        max_queue_size: Queue bound; beyond it the oldest items are dropped.
        flush_timeout: Seconds after which a partial batch is reduced anyway (``None``: never).
        max_staleness: How many versions a gradient may be behind (``None``: unbounded).
    """

    server_name: str
    model_name: str
    me: str
    primary_reducer: str
    secondary_reducers: tuple[str, ...]
    reduce_method: str
    reduce_device: torch.device
    reduce_batch_size: int
    max_queue_size: int
    flush_timeout: float | None
    max_staleness: int | None

    @property
    def is_primary(self) -> bool:
        """Whether this process is the primary reducer."""
        return self.me == self.primary_reducer

    @property
    def is_secondary(self) -> bool:
        """Whether this process is a secondary reducer."""
        return self.me in self.secondary_reducers

    @property
    def other_secondaries(self) -> frozenset[str]:
        """The secondaries that live in other processes than the primary."""
        return frozenset(self.secondary_reducers) - {self.primary_reducer}

    @classmethod
    def build(
        cls,
        group: GroupLike,
        server_name: str,
        model_name: str = "model",
        primary_reducer: str | None = None,
        secondary_reducers: Sequence[str] | None = None,
        reduce_method: str = "sum",
        reduce_device: torch.device | str = "cpu",
        reduce_batch_size: int = 4,
        max_queue_size: int = 64,
        flush_timeout: float | None = 1.0,
        max_staleness: int | None = None,
    ) -> GradServerConfig:
        """Validate the arguments of :class:`~pc_server.PushPullGradServerImpl` against ``group``.

        Args:
            group: The RpcGroup of the reducers.
            server_name: See :class:`~pc_server.PushPullGradServerImpl`.
            model_name: Same.
            primary_reducer: Same; default: the first (sorted) group member.
            secondary_reducers: Same; default: every group member.
            reduce_method: Same.
            reduce_device: Same.
            reduce_batch_size: Same.
            max_queue_size: Same.
            flush_timeout: Same.
            max_staleness: Same.

        Returns:
            The frozen configuration.

        Raises:
            TypeError: Wrong argument types.
            ValueError: Bad values, named in the message.
        """
        batch = positive_int("reduce_batch_size", reduce_batch_size)
        queue = positive_int("max_queue_size", max_queue_size)
        if queue < batch:
            raise ValueError(
                f"max_queue_size ({max_queue_size}) must be >= reduce_batch_size ({reduce_batch_size})"
            )
        staleness = optional_non_negative_int("max_staleness", max_staleness)
        members = list(group.get_group_members())
        me = group.get_cur_name()
        primary = members[0] if primary_reducer is None else check_name("primary_reducer", primary_reducer)
        if secondary_reducers is None:
            secondary_reducers = members
        if not isinstance(secondary_reducers, (list, tuple)) or not secondary_reducers:
            raise ValueError(
                f"secondary_reducers must be a non-empty list of names, got {secondary_reducers!r}"
            )
        secondaries = tuple(check_name("secondary reducer", m) for m in secondary_reducers)
        if len(set(secondaries)) != len(secondaries):
            raise ValueError(f"secondary_reducers has duplicates: {list(secondaries)}")
        unknown = [m for m in [primary, *secondaries] if m not in members]
        if unknown:
            raise ValueError(f"reducers {unknown} are not members of the group (members: {members})")
        if me != primary and me not in secondaries:
            raise ValueError(
                f"process {me!r} is neither the primary reducer ({primary!r}) nor a "
                f"secondary ({list(secondaries)}); construct the Impl on reducers only"
            )
        return cls(
            server_name=check_name("server_name", server_name),
            model_name=check_name("model_name", model_name),
            me=me,
            primary_reducer=primary,
            secondary_reducers=secondaries,
            reduce_method=check_reduce_method(reduce_method),
            reduce_device=torch.device(reduce_device),
            reduce_batch_size=batch,
            max_queue_size=queue,
            flush_timeout=optional_positive_seconds("flush_timeout", flush_timeout),
            max_staleness=staleness,
        )
