"""The primary reducer: merges the secondaries' bundles, steps the optimizer, publishes each new version.

It owns its queue, its thread, the managed model, optimizer and lr scheduler, the model version and the set of
secondaries that said they are done (so that its ``stop()`` can wait for them).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from pc_server._checkpoint import check_int
from pc_server._copy import snapshot
from pc_server._packing import Packed, unpack
from pc_server._state import check_model, model_snapshot, set_pp_version
from pc_server.grad._fit import check_loadable, check_model_state, type_name
from pc_server.grad._protocol import Done, Forward
from pc_server.grad._reduce import Partial, finalize, merge_partials
from pc_server.grad._reducer_base import (
    Booking,
    ReducerHealth,
    ReducerRole,
    forward_clients,
    per_client,
)
from pc_server.grad.config import GradServerConfig
from pc_server.grad.ledger import LedgerBook
from pc_server.ordered_server import OrderedServerBase, OrderedServerSimpleImpl

__all__ = ["PrimaryReducer"]

logger = logging.getLogger(__name__)


class PrimaryReducer(ReducerRole[tuple[Forward, float]]):
    """The primary reducer of a gradient server (in the primary's process only).

    Args:
        config: The server's settings.
        ledger: The process's ledger.
        health: The process's failure record; its condition is notified after every step.
        o_server: The ordered server accessor the model is published to.
        o_server_impl: The ordered server itself when hosted in this process (published to without an RPC).
    """

    role = "primary"

    def __init__(
        self,
        config: GradServerConfig,
        ledger: LedgerBook,
        health: ReducerHealth,
        o_server: OrderedServerBase,
        o_server_impl: OrderedServerSimpleImpl | None,
    ) -> None:
        super().__init__(
            config, ledger, health, lambda item: ledger.record("dropped_overflow", forward_clients(item[0]))
        )
        self.o_server = o_server
        self.o_server_impl = o_server_impl
        self.model: nn.Module | None = None
        self.optimizer: Any = None
        self.lr_scheduler: Any = None
        self.version = 0
        self.steps = 0
        self._done: set[str] = set()  # secondaries whose stop() finished
        # held for a step and its ledger entries, so that a checkpoint sees the model, optimizer, version and
        # applied counts of one and the same step
        self.step_lock = threading.RLock()

    def _clients_of(self, item: tuple[Forward, float]) -> dict[str, int]:
        return forward_clients(item[0])

    def manage(self, model: nn.Module, optimizer: Any, lr_scheduler: Any) -> None:
        """Take the model (see ``PushPullGradServerImpl.manage_model``) and publish version 0.

        Raises:
            TypeError: Bad argument types.
            RuntimeError: The ordered server already holds the model's key.
        """
        check_model(model)
        if not callable(getattr(optimizer, "step", None)):
            raise TypeError(f"optimizer must have a step() method, got {type(optimizer).__name__}")
        if lr_scheduler is not None and not callable(getattr(lr_scheduler, "step", None)):
            raise TypeError(f"lr_scheduler must have a step() method, got {type(lr_scheduler).__name__}")
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.version = 0
        set_pp_version(model, 0)
        if not self._publish(0, None):
            raise RuntimeError(
                f"ordered server already holds {self.config.model_name!r}: another writer published it first"
            )

    def receive(self, forward: Forward | Done, age: float) -> int:
        """Queue a secondary's bundle, or note that it is done; return the model version.

        Raises:
            TypeError: ``forward`` is not a bundle from a secondary.
            ReducerStoppedError: The primary stopped or failed.
        """
        if isinstance(forward, Done):
            with self.health.cond:
                self._done.add(forward.member)
                self.health.cond.notify_all()
            return self.version
        if not isinstance(forward, Forward):
            raise TypeError(
                f"expected a gradient bundle from a secondary reducer, got {type(forward).__name__}"
            )
        self.queue.put((forward, age), age=age)
        return self.version

    def wait_for_version(self, version: int, timeout: float) -> bool:
        """Wait until the model reaches ``version``; ``False`` on timeout or failure."""
        with self.health.cond:
            self.health.cond.wait_for(
                lambda: self.version >= version or self.health.error is not None, timeout
            )
            return self.version >= version

    def wait_for_secondaries(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until every secondary in another process said it is done."""
        others = self.config.other_secondaries
        with self.health.cond:
            done = self.health.cond.wait_for(
                lambda: others <= self._done or self.health.error is not None, timeout
            )
            missing = sorted(others - self._done)
        if not done:
            logger.warning(
                "gradient server %r: secondaries %s did not stop within %s s of the primary; pushes they "
                "still hold will be dropped at shutdown (booked in their ledgers)",
                self.config.server_name,
                missing,
                timeout,
            )

    def _reduce(
        self, batch: list[tuple[Forward, float]]
    ) -> tuple[dict[int, Partial], dict[int, Counter[str]]]:
        device = self.config.reduce_device
        clients: dict[int, Counter[str]] = {}
        parts = []
        for fwd, _age in batch:
            part = {}
            for v, (packed, count, per) in fwd.partials.items():
                part[v] = Partial(unpack(packed, device), count)
                clients.setdefault(v, Counter()).update(per)
            parts.append(part)
        return merge_partials(parts, None), clients

    def _head(self) -> int:
        return self.version

    def _guard(self) -> AbstractContextManager[Any]:
        return self.step_lock  # a checkpoint sees the model, version and ledger of one and the same step

    def _deliver(
        self, kept: dict[int, Partial], clients: dict[int, Counter[str]], batch: list[tuple[Forward, float]]
    ) -> Booking:
        grads, _count = finalize(kept, self.config.reduce_method)
        self._step(grads)
        with self.health.cond:
            self.steps += 1
            self.health.cond.notify_all()
        return "applied", per_client(clients[v] for v in kept)

    def state(self) -> dict[str, Any]:
        """Model, optimizer and lr scheduler state dicts, version, step count and the bundles not applied yet.

        The copies are of one step; call it under the ledger's lock (as the checkpoint does) so that the
        ``pending`` bundles (queued, or taken for the next step) and the ledger agree.

        Raises:
            RuntimeError: No model is managed yet.
        """
        if self.model is None:
            raise RuntimeError("call manage_model() before state_dict(): the primary holds no model yet")
        with self.step_lock:
            return {
                "version": self.version,
                "steps": self.steps,
                "model": snapshot(self.model.state_dict()),
                "optimizer": _state_of(self.optimizer),
                "optimizer_type": type_name(self.optimizer),
                "lr_scheduler": _state_of(self.lr_scheduler),
                "lr_scheduler_type": type_name(self.lr_scheduler),
                "pending": [
                    {v: [packed, count, dict(per)] for v, (packed, count, per) in fwd.partials.items()}
                    for fwd, _age in self.queue.pending()
                ],
            }

    def check_load(self, state: object) -> tuple[Callable[[], None], list[tuple[Forward, float]]]:
        """Validate :meth:`state`'s output against the managed objects; change nothing yet.

        Returns:
            The step that loads the model, optimizer and scheduler state and publishes the version (it puts
            everything back and raises if any of that fails), and the held bundles to queue again
            (:meth:`restore_pending`).

        Raises:
            RuntimeError: No model is managed yet.
            TypeError: The checkpoint's optimizer or scheduler is of another type than the managed one.
            ValueError: A malformed entry, or state that does not fit the managed objects (named).
        """
        model = self.model
        if model is None:
            raise RuntimeError("call manage_model() before load_state_dict(): the primary holds no model yet")
        if not isinstance(state, dict) or not {"version", "steps", "model"} <= state.keys():
            raise ValueError(f"primary state must hold version, steps and model, got {state!r:.200}")
        version = check_int("primary version", state["version"])
        steps = check_int("primary steps", state["steps"])
        check_model_state(model, state["model"])
        parts = {"optimizer": self.optimizer, "lr_scheduler": self.lr_scheduler}
        for what, obj in parts.items():
            check_loadable(what, obj, state.get(what), state.get(f"{what}_type"))
        pending = [(_bundle(i, entry), 0.0) for i, entry in enumerate(state.get("pending", []))]

        def load() -> None:
            self._load_managed(
                model, {what: state.get(what) for what in parts}, state["model"], version, steps
            )

        return load, pending

    def _load_managed(
        self, model: nn.Module, states: dict[str, Any], model_state: Any, version: int, steps: int
    ) -> None:
        """Load the checkpoint into the managed objects and publish its version; all or nothing."""
        parts = [("model", model, model_state)]
        parts += [(what, getattr(self, what), states[what]) for what in ("optimizer", "lr_scheduler")]
        touched: list[tuple[str, Any, Any]] = []  # (what, object, its state before), loaded or being loaded
        prev = (self.version, self.steps)
        try:
            for what, obj, state in parts:
                if state is not None:
                    touched.append((what, obj, _state_of(obj)))
                    _load_into(what, obj, state)
            with self.step_lock, self.health.cond:
                self.version, self.steps = version, steps
            set_pp_version(model, version)
            if not self._publish(version, prev[0]):
                raise RuntimeError(
                    f"gradient server {self.config.server_name!r}: publishing the restored version {version} "
                    f"of {self.config.model_name!r} was refused; another process writes the same key"
                )
        except BaseException:
            for what, obj, saved in reversed(touched):
                try:
                    obj.load_state_dict(saved)
                except Exception as undo:  # the load's own error is the one raised; this one is logged
                    logger.error("the managed %s could not be put back as it was: %r", what, undo)
            with self.step_lock, self.health.cond:
                self.version, self.steps = prev
            set_pp_version(model, prev[0])
            raise

    def _step(self, grads: dict[str, torch.Tensor]) -> None:
        model = self.model
        if model is None:  # start() checks this; kept for the type checker
            raise RuntimeError("no managed model")
        params = dict(model.named_parameters())
        unknown = sorted(grads.keys() - params.keys())
        if unknown:
            raise ValueError(f"pushed gradients name parameters the managed model lacks: {unknown}")
        for name, param in params.items():
            param.grad = None
            if not param.requires_grad:
                continue
            grad = grads.get(name)
            if grad is None:
                raise ValueError(f"pushed gradients lack managed parameter {name!r}")
            param.grad = grad.to(param.device, param.dtype)
        self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        new = self.version + 1
        set_pp_version(model, new)
        if not self._publish(new, new - 1):
            raise RuntimeError(
                f"gradient server {self.config.server_name!r}: publishing version {new} of "
                f"{self.config.model_name!r} was refused; another process writes the same key"
            )
        with self.health.cond:  # only once published: a pull after wait_for_version sees this version
            self.version = new
            self.health.cond.notify_all()

    def _publish(self, version: int, prev: int | None) -> bool:
        if self.model is None:  # manage() sets it first; kept for the type checker
            raise RuntimeError("no managed model")
        snap = model_snapshot(self.model)
        if self.o_server_impl is not None:  # hosted here: no RPC, and the snapshot is already private
            return self.o_server_impl.push_snapshot(self.config.model_name, snap, version, prev)
        return self.o_server.push(self.config.model_name, snap, version, prev)


def _bundle(index: int, entry: object) -> Forward:
    """A checkpointed pending bundle, validated; the message names ``pending[index]``."""
    what = f"primary pending[{index}]"
    if not isinstance(entry, dict):
        raise ValueError(
            f"{what} must map version -> [gradients, count, pushes per client], got {entry!r:.200}"
        )
    partials: dict[int, tuple[Packed, int, dict[str, int]]] = {}
    for v, part in entry.items():
        if not (isinstance(part, (list, tuple)) and len(part) == 3 and isinstance(part[0], Packed)):
            raise ValueError(
                f"{what}[{v!r}] must be [packed gradients, count, pushes per client], got {part!r:.200}"
            )
        per = part[2]
        if not isinstance(per, dict):
            raise ValueError(f"{what}[{v!r}] pushes per client must be a dict, got {per!r:.200}")
        counts = {str(c): check_int(f"{what}[{v!r}] pushes of {c!r}", n, 1) for c, n in per.items()}
        partials[check_int(f"{what} version", v)] = (
            part[0],
            check_int(f"{what}[{v!r}] count", part[1], 1),
            counts,
        )
    return Forward(partials)


def _state_of(obj: Any) -> Any:
    state_dict = getattr(obj, "state_dict", None)
    return snapshot(state_dict()) if callable(state_dict) else None


def _load_into(what: str, obj: Any, state: Any) -> None:
    """Load a checkpointed state dict (checked by ``pc_server.grad._fit``) into the managed ``obj``."""
    if state is None:
        return
    try:
        obj.load_state_dict(state)
    except (RuntimeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"the checkpoint's {what} state does not fit the managed {what}: {exc}") from exc
