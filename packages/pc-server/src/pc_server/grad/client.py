"""The gradient server's client accessor: push gradients to a secondary reducer, pull the newest model.

A push is one RPC carrying every ``requires_grad`` parameter's gradient packed into one buffer per dtype, with
``(client, seq, pp_version)``; the secondary queues it and replies at once. The secondary is chosen by
rotation starting at ``crc32(seed) % n`` (the seed defaults to this process's name), so runs are reproducible;
a transport error is retried once on the same secondary (its ``(client, seq)`` table recognises a push it
already received, so a lost reply never applies a push twice), then once on the next secondary. A secondary
(and an ordered server) in the client's own process is called without an RPC to itself: ``RpcGroup`` runs
its service in the caller's thread, on the copies an RPC would make.
"""

from __future__ import annotations

import itertools
import logging
import threading
import uuid
import zlib
from typing import Any

import torch
from torch import nn

from pc_server._group import GroupLike, call_service, check_group, check_name
from pc_server._packing import pack
from pc_server._state import check_model, get_pp_version, pull_model
from pc_server.grad._protocol import GradMessage, ledger_service_name, reducer_service_name
from pc_server.grad.ledger import GradLedger
from pc_server.ordered_server import OrderedServerBase

__all__ = ["PushPullGradServer"]

logger = logging.getLogger(__name__)


def collect_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """The gradients of every ``requires_grad`` parameter, keyed by ``named_parameters`` name.

    Raises:
        RuntimeError: A parameter that requires grad has none, named in the message.
    """
    grads: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.grad is None:
            raise RuntimeError(f"parameter {name!r} has no gradient to push; run backward() first")
        grads[name] = param.grad
    if not grads:
        raise RuntimeError("the model has no parameters that require grad: nothing to push")
    return grads


class PushPullGradServer:
    """Accessor to a :class:`~pc_server.PushPullGradServerImpl` tree: push gradients, pull the newest model.

    Get it with ``group.get_paired(server_name).to_here()``; it is picklable, and each unpickled copy is a
    separate client (its own identity and sequence numbers).

    Safe to share between threads: a push takes the next sequence number and sends the message it labels
    under the accessor's lock, so each secondary sees one client's pushes in sequence order and never takes
    a concurrent push for a retry. The threads' sends are therefore one at a time (the closing pull is not
    serialised); a thread that wants its own sends in parallel uses an accessor of its own (``to_here()``
    again). A model passed to :meth:`push` or :meth:`pull` must not be used by another thread meanwhile.

    Args:
        server_name: The gradient server's name.
        group: The RpcGroup of the reducers.
        model_name: The model's key in the ordered server.
        secondary_reducers: Names of the secondary reducers, in rotation order.
        o_server: The ordered server accessor holding the published model.
        primary_reducer: The primary reducer's name (asked by :meth:`ledger`; ``None``: only the secondaries).
    """

    def __init__(
        self,
        server_name: str,
        group: GroupLike,
        model_name: str,
        secondary_reducers: list[str],
        o_server: OrderedServerBase,
        primary_reducer: str | None = None,
    ) -> None:
        self.server_name = check_name("server_name", server_name)
        self.group = check_group(group)
        self.model_name = check_name("model_name", model_name)
        if not isinstance(secondary_reducers, (list, tuple)) or not secondary_reducers:
            raise ValueError(
                f"secondary_reducers must be a non-empty list of names, got {secondary_reducers!r}"
            )
        self.secondary_reducers = [check_name("secondary reducer", m) for m in secondary_reducers]
        if not isinstance(o_server, OrderedServerBase):
            raise TypeError(f"o_server must be an OrderedServerBase accessor, got {type(o_server).__name__}")
        self.o_server = o_server
        self.primary_reducer = (
            None if primary_reducer is None else check_name("primary_reducer", primary_reducer)
        )
        self._services = [reducer_service_name(server_name, m) for m in self.secondary_reducers]
        self._client: str | None = None
        self._seq = 0
        self._next: int | None = None
        # held while a push takes its seq and is sent: per client, a secondary sees seqs in order
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        state.update(_client=None, _seq=0, _next=None)  # every copy is a new client
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"PushPullGradServer(server_name={self.server_name!r}, "
            f"secondary_reducers={self.secondary_reducers!r})"
        )

    def set_seed(self, seed: int | str) -> None:
        """Restart the secondary rotation at ``crc32(str(seed)) % len(secondary_reducers)``.

        Args:
            seed: Any int or str; the default seed is this process's name.

        Raises:
            TypeError: ``seed`` is neither an int nor a str.
        """
        if isinstance(seed, bool) or not isinstance(seed, (int, str)):
            raise TypeError(f"seed must be an int or a str, got {type(seed).__name__}")
        with self._lock:
            self._next = zlib.crc32(str(seed).encode()) % len(self._services)

    @property
    def client_id(self) -> str:
        """This accessor's client identity, the key of its entry in :meth:`ledger` (fixed at first use)."""
        with self._lock:
            return self._client_id()

    def _client_id(self) -> str:  # under self._lock
        if self._client is None:
            self._client = f"{self.group.get_cur_name()}/{uuid.uuid4().hex[:12]}"
        return self._client

    def ledger(self) -> GradLedger:
        """The server's merged ledger, asked of every reducer (one RPC each): what became of every push.

        ``ledger().clients[client_id]`` tells this client how many of its pushes were applied and how many
        were dropped, and why. It balances (``accepted == applied + dropped``) once every reducer stopped.

        Raises:
            ConnectionError: A reducer is unreachable.
            TimeoutError: A reducer did not answer within the RPC timeout.
        """
        return GradLedger.merge(
            self._call(ledger_service_name(self.server_name, m), ()) for m in self._reducers()
        )

    def _call(self, service: str, args: tuple[Any, ...]) -> Any:
        """Call a reducer's service (one RPC; none when the reducer lives in this process)."""
        return call_service(self.group, service, args, self.server_name)

    def _reducers(self) -> list[str]:
        primary = self.primary_reducer
        extra = [primary] if primary is not None and primary not in self.secondary_reducers else []
        return [*self.secondary_reducers, *extra]

    def next_secondary(self) -> str:
        """The secondary reducer the next push goes to (without advancing the rotation)."""
        with self._lock:
            return self.secondary_reducers[self._peek()]

    def _peek(self) -> int:  # under self._lock
        if self._next is None:
            self._next = zlib.crc32(self.group.get_cur_name().encode()) % len(self._services)
        return self._next

    def push(self, model: nn.Module) -> bool:
        """Push ``model``'s gradients to a secondary reducer, then :meth:`pull` the newest model.

        The push returns once the gradients are queued; they are applied asynchronously, in a later batch (so
        the pulled model may not include them yet). The gradients must exist for every parameter that requires
        grad. After the call the model's gradients are cleared (``None``).

        Args:
            model: The model whose gradients to push; its ``pp_version`` (0 when absent) is the version the
                gradients were computed on.

        Returns:
            ``True`` if a reducer accepted the gradients; ``False`` if it refused them as too stale
            (``max_staleness``), as computed on a version ahead of the server's (a model kept across a
            restore from an older checkpoint), or as a duplicate.

        Raises:
            TypeError: ``model`` is not a module or ``pp_version`` is not an int.
            RuntimeError: A parameter has no gradient, or the reducer stopped (:class:`ReducerStoppedError`).
            ValueError: The gradients do not match the ones the reducer has seen (names or shapes).
            ConnectionError: No secondary (after one retry) or the model's server is reachable.
            TimeoutError: A server did not answer within the RPC timeout.
        """
        check_model(model)
        grads = collect_grads(model)
        version = get_pp_version(model)
        with self._lock:  # the seq and the message it labels, sent before the next push takes a seq
            reply = self._send(grads, version)
        self.pull(model)
        return bool(reply[0])

    def _send(self, grads: dict[str, torch.Tensor], version: int) -> Any:
        """Send one push under the new seq (call under ``self._lock``): the reducer's reply."""
        self._seq += 1
        seq, client = self._seq, self._client_id()
        first = self._peek()
        self._next = (first + 1) % len(self._services)
        # the same secondary first (its dedup table makes the retry safe), then the next one
        attempts = (
            [first, first] if len(self._services) == 1 else [first, first, (first + 1) % len(self._services)]
        )
        for index, retry in itertools.pairwise(attempts):
            try:
                return self._send_to(index, grads, client, seq, version)
            except ConnectionError:
                logger.warning(
                    "gradient server %r: secondary %r unreachable, retrying (same seq) on %r",
                    self.server_name,
                    self.secondary_reducers[index],
                    self.secondary_reducers[retry],
                )
        return self._send_to(attempts[-1], grads, client, seq, version)

    def _send_to(
        self, index: int, grads: dict[str, torch.Tensor], client: str, seq: int, version: int
    ) -> Any:
        service = self._services[index]
        # The call copies what it sends (serialised over RPC, copied by the group in this process), and that
        # copy is what the reducer keeps: large CPU gradients are packed as they are.
        return self._call(service, (GradMessage(pack(grads, copy=False), client, seq, version),))

    def pull(self, model: nn.Module) -> bool:
        """Clear the model's gradients (set to ``None``) and load the server's model if its version differs.

        The server's model is loaded when ``model.pp_version`` is behind it, absent, or ahead of it (a model
        kept across a server restored from an older checkpoint; loading it costs a second call then), so that
        the next gradients are computed on the server's model. ``manage_model`` publishes version 0, so a
        first pull returns ``True`` as soon as the primary manages its model.

        Args:
            model: The model.

        Returns:
            ``False`` if no model has been published yet, else ``True``.

        Raises:
            TypeError: ``model`` is not a module.
            ConnectionError: The model's server is unreachable.
            TimeoutError: It did not answer within the RPC timeout.
        """
        check_model(model).zero_grad(set_to_none=True)
        return pull_model(self.o_server, self.model_name, model, exact=True)
