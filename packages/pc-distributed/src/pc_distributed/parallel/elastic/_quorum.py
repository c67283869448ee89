"""One quorum per step attempt and one decision per attempt, agreed through the store.

Keys (under the job's prefix), for attempt ``a`` (attempts are numbered across steps: an aborted step is
re-run as the next attempt)::

    ready/<a>/<name>   a member is at the step boundary; the value is its committed step count (-1: never
                       synchronised, a new member)
    q/<a>              the quorum, JSON (:class:`Quorum`), set once by compare_set: the first proposal wins
    latest             the last attempt whose quorum was decided (where a new member starts looking)
    committed          the job's committed steps (set by each committed step's housekeeper, its quorum's
                       last member by name, on a thread of its own: ``_housekeeper``)
    done/<a>/<name>    the member finished the attempt's all-reduce
    decide/<a>         "commit" or "abort", set once by compare_set

Quorum: every member writes its ready key and waits until every registered member that is alive (see
``_membership``) has written one. Then the lowest of them (or, if its proposal does not come within the
member timeout, any of them) proposes the ready members (those most up to date first,
then in join order, at most ``max_members``) and everyone reads the proposal that won. Members missing
after ``quorum_timeout`` are left out if the others are at least ``min_members``; below ``min_members`` the
wait goes on until ``quorum_timeout`` and then raises ``TimeoutError`` naming who is missing.

Next quorum with the commit: right after an attempt commits, its lowest member decides the next attempt's
quorum if nothing changed (:func:`propose_next`); a member reaching a boundary whose quorum is decided
returns it at once, without waiting for the others' ready keys.

Decision: a member that finished the all-reduce writes its done key and waits for every quorum member's;
seeing them all it proposes "commit"; a member whose all-reduce failed, or that sees a quorum member die or
``step_timeout`` pass before all done keys are there, proposes "abort". The first proposal wins and every
member applies the step iff it reads "commit". A commit thus needs every member to have finished the
reduction, so every member that applies the step applies the same average.

Retention: when attempt ``a`` commits, its housekeeper deletes the keys of attempt ``a - RETAIN``
(:func:`forget`, on its housekeeping thread),
so the store holds a bounded window of attempts however long the job runs. A member stopped or cut off for
longer than that (its attempt's quorum gone, ``latest`` at least ``RETAIN`` ahead) finds out the first time
its fast path misses and raises :class:`StaleAttempt`: it then enters at the current boundary as a member
that is behind and receives the state, and never proposes a quorum of its own for an attempt the others
decided long ago.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pc_distributed import _store
from pc_distributed._store import BoundedStore
from pc_distributed._torch_errors import is_connection_loss
from pc_distributed.parallel.elastic._connect import ElasticStores
from pc_distributed.parallel.elastic._membership import Membership

__all__ = [
    "RETAIN",
    "Quorum",
    "QuorumRules",
    "StaleAttempt",
    "decide",
    "forget",
    "form_quorum",
    "propose_next",
    "start_attempt",
]

_PAST_EXPIRY = 0.01
"""Seconds a wait outlasts the moment a silent member turns dead (so that it is dead when the wait ends)."""

COMMIT = "commit"
ABORT = "abort"
RETAIN = 64
"""Attempts whose keys the store keeps behind the newest committed one (older ones are deleted)."""


class StaleAttempt(Exception):  # noqa: N818 - a signal between the quorum and the trainer, not an error
    """This member's attempt was decided and forgotten long ago: it must enter at the current boundary."""


@dataclass(frozen=True)
class Quorum:
    """The members of one step attempt, as decided through the store.

    Attributes:
        attempt: The attempt's number.
        members: The members, sorted by name (the group's ranks follow this order).
        step: The committed step count the members start the attempt from (after the state transfer).
        source: The member whose state the others receive (lowest name among the most up to date).
        sync: The members that receive ``source``'s state before the step (behind, or new).
        group: The attempt whose process group this quorum uses (a quorum equal to the previous committed
            one keeps its group; any change makes a new one).
    """

    attempt: int
    members: tuple[str, ...]
    step: int
    source: str
    sync: tuple[str, ...]
    group: int

    def to_json(self) -> str:
        """The stored form."""
        return json.dumps(
            {
                "attempt": self.attempt,
                "members": list(self.members),
                "step": self.step,
                "source": self.source,
                "sync": list(self.sync),
                "group": self.group,
            }
        )

    @classmethod
    def from_json(cls, text: bytes | str) -> Quorum:
        """Parse the stored form."""
        d = json.loads(text)
        return cls(d["attempt"], tuple(d["members"]), d["step"], d["source"], tuple(d["sync"]), d["group"])


@dataclass(frozen=True)
class QuorumRules:
    """What a quorum may be and how long members wait for one (the trainer's settings, validated there).

    Attributes:
        min_members: Fewest members a quorum may have.
        initial_members: Fewest members the job's first quorum (no member has trained yet) may have.
        max_members: Most members a quorum may have.
        timeout: Seconds to wait for missing live members (and, below ``min_members``, for anyone).
        period: Seconds of each wait for missing members' keys before the liveness view is read again (the
            member timeout: a wait that times out costs torch a reconnection and a warning, so the waits are
            as long as liveness allows).
    """

    min_members: int
    initial_members: int
    max_members: int
    timeout: float
    period: float


def _latest(store: BoundedStore) -> int | None:
    """The ``latest`` key's attempt, or None if it is not set, in one request (``lookup``'s compare_set).

    Only for keys nobody waits on: torch's libuv TCPStore server wakes the waiters of a key that such a
    look-up finds missing, as if it had been set.
    """
    value = _store.lookup(store, "latest")
    return None if value is None else int(value)


def start_attempt(stores: ElasticStores) -> int:
    """The attempt a new member enters at: the one after the last decided quorum."""
    latest = _latest(stores.store)
    return 0 if latest is None else latest + 1


def _wait_slice(stores: ElasticStores, keys: Sequence[str], seconds: float) -> bool:
    """Wait up to ``seconds`` for all ``keys``; return whether they are all there (a lost store raises)."""
    try:
        stores.waits.wait(list(keys), max(seconds, 0.01))
        return True
    except RuntimeError as exc:  # torch's DistStoreError on a wait's timeout, or a lost connection
        if is_connection_loss(exc):
            raise ConnectionError(
                f"lost the elastic store while waiting for {list(keys)[:3]}: {exc}"
            ) from exc
        return False


def _previous(
    stores: ElasticStores, attempt: int, known: tuple[Quorum, bool] | None
) -> tuple[Quorum, bool] | None:
    """Attempt ``attempt - 1``'s quorum and whether it committed (None if not in the store).

    A member that took part in it knows both; only a member that did not reads them back from the store.
    """
    if known is not None and known[0].attempt == attempt - 1:
        return known
    if attempt == 0 or not stores.store.check([f"q/{attempt - 1}", f"decide/{attempt - 1}"]):
        return None
    quorum = Quorum.from_json(stores.store.get(f"q/{attempt - 1}"))
    return quorum, stores.store.get(f"decide/{attempt - 1}").decode() == COMMIT


def _propose(
    stores: ElasticStores,
    attempt: int,
    ready: dict[str, int],
    order: list[str],
    max_members: int,
    known: tuple[Quorum, bool] | None,
) -> Quorum:
    """Build this member's proposal for ``attempt`` from the ready members and their step counts."""
    rank_of = {n: i for i, n in enumerate(order)}
    chosen = sorted(ready, key=lambda n: (-ready[n], rank_of.get(n, len(order)), n))[:max_members]
    top = max(ready[n] for n in chosen)
    members = tuple(sorted(chosen))
    source = min(n for n in chosen if ready[n] == top)
    sync = tuple(n for n in members if n != source and (ready[n] < top or top < 0))
    group = attempt
    previous = None if sync else _previous(stores, attempt, known)
    if previous is not None and previous[1] and previous[0].members == members:
        group = previous[0].group
    return Quorum(attempt, members, max(top, 0), source, sync, group)


def form_quorum(
    stores: ElasticStores,
    membership: Membership,
    attempt: int,
    version: int,
    rules: QuorumRules,
    known: tuple[Quorum, bool] | None = None,
) -> Quorum:
    """Enter ``attempt``'s step boundary and return its decided quorum (which may not include this member).

    Args:
        stores: The member's store connections.
        membership: The liveness view.
        attempt: The attempt's number.
        version: This member's committed step count (-1 before its first synchronisation).
        rules: The quorum's size limits and waits.
        known: This member's last quorum and whether it committed (saves reading it back from the store).

    Raises:
        TimeoutError: If fewer than ``rules.min_members`` are ready after ``rules.timeout``, naming who is
            missing.
        ConnectionError: If the store is lost.
        StaleAttempt: If the attempt was decided and forgotten while this member was away.
    """
    min_members, initial_members, max_members = rules.min_members, rules.initial_members, rules.max_members
    timeout, period = rules.timeout, rules.period
    me = membership.name
    store = stores.store
    store.set(f"ready/{attempt}/{me}", str(version))
    key = f"q/{attempt}"
    if store.check([key]):  # decided already, with the last commit (propose_next) or by the others
        return Quorum.from_json(store.get(key))
    membership.refresh_registry()  # steps are faster than heartbeats: see who enlisted since the last beat
    deadline = time.monotonic() + timeout
    deferred = False
    while True:
        if membership.error is not None:
            raise ConnectionError(
                f"elastic member {me!r} lost the store: {membership.error}"
            ) from membership.error
        order = membership.registered()
        live = [n for n in order if membership.alive(n)]
        ready_keys = {n: f"ready/{attempt}/{n}" for n in live}
        # One request in the common case: returns as soon as every live member is at the boundary.
        wait = min(period, membership.until_expiry(live) + _PAST_EXPIRY, deadline - time.monotonic())
        everyone = _wait_slice(stores, list(ready_keys.values()), wait)
        if everyone and me != min(live) and not deferred:
            deferred = True  # the lowest live member proposes; the others read its proposal
            wait = min(period, membership.until_expiry(live) + _PAST_EXPIRY, deadline - time.monotonic())
            if _wait_slice(stores, [key], wait):
                return Quorum.from_json(store.get(key))
        if store.check([key]):  # not a one-request look-up: the others may be waiting for this key
            return Quorum.from_json(store.get(key))
        if _forgotten(store, attempt):
            raise StaleAttempt(f"attempt {attempt} of elastic member {me!r} was decided and forgotten")
        if everyone:  # every key is there: one request for all the values
            values = store.multi_get(list(ready_keys.values()))
            ready = {n: int(v.decode()) for n, v in zip(ready_keys, values, strict=True)}
        else:
            ready = {n: int(store.get(k).decode()) for n, k in ready_keys.items() if store.check([k])}
        missing = [n for n in live if n not in ready]
        late = time.monotonic() >= deadline
        fresh = all(v < 0 for v in ready.values())
        fewest = initial_members if fresh else min_members
        orphaned = fresh and bool(ready) and store.check(["committed"])  # new members alone, state lost
        if len(ready) >= fewest and not orphaned and (not missing or late):
            proposal = _propose(stores, attempt, ready, order, max_members, known)
            won = Quorum.from_json(store.compare_set(key, "", proposal.to_json()))
            if won == proposal:
                store.set("latest", str(attempt))
            return won
        if late:
            dead = [n for n in order if n not in live]
            if orphaned:
                raise TimeoutError(
                    f"elastic member {me!r}: the job has committed {store.get('committed').decode()} steps "
                    f"but no live member holds its state after {timeout:g} s (ready: {sorted(ready)}, dead "
                    f"or left: {dead}); a new member cannot start it over"
                )
            raise TimeoutError(
                f"elastic member {me!r}: a quorum needs at least {fewest} members, only {len(ready)} "
                f"({sorted(ready)}) were at step boundary {attempt} after {timeout:g} s; missing: alive but "
                f"not ready {missing}, dead or left {dead}"
            )
        membership.refresh()


def _forgotten(store: BoundedStore, attempt: int) -> bool:
    """Whether ``attempt``'s keys were deleted: ``latest`` is at least :data:`RETAIN` attempts ahead of it.

    Keys are deleted only when an attempt ``RETAIN`` later commits, after its quorum set ``latest``, and a
    forgotten attempt's quorum key is gone: so an attempt that passes this test is never proposed again.
    """
    latest = _latest(store)
    return latest is not None and latest >= attempt + RETAIN


def forget(store: BoundedStore, attempt: int, names: Sequence[str]) -> None:
    """Delete the keys of ``attempt`` (by the housekeeper of the attempt ``RETAIN`` later, once committed).

    Args:
        store: A client of the job's keys.
        attempt: The attempt to forget (nothing happens below 0).
        names: Every member that may have written a ready key (the registry).
    """
    if attempt < 0:
        return
    quorum = f"q/{attempt}"
    members = Quorum.from_json(store.get(quorum)).members if store.check([quorum]) else ()
    keys = [f"ready/{attempt}/{n}" for n in dict.fromkeys(names)]
    keys += [f"done/{attempt}/{n}" for n in members]
    keys += [f"decide/{attempt}", quorum]  # the quorum last: while it is there, the attempt is not forgotten
    for k in keys:
        store.delete_key(k)


def decide(
    stores: ElasticStores,
    membership: Membership,
    quorum: Quorum,
    reduced: bool,
    timeout: float,
    period: float,
) -> bool:
    """Agree with the quorum whether its attempt commits; return True iff it does.

    Args:
        stores: The member's store connections.
        membership: The liveness view.
        quorum: The attempt's quorum.
        reduced: Whether this member's all-reduce (and state transfer) succeeded.
        timeout: Seconds to wait for the other members' done keys.
        period: Seconds of each wait for the done keys before liveness is checked again.
    """
    a, store = quorum.attempt, stores.store
    key = f"decide/{a}"
    verdict = ABORT
    if reduced:
        store.set(f"done/{a}/{membership.name}", "1")
        done_keys = [f"done/{a}/{n}" for n in quorum.members]
        deadline = time.monotonic() + timeout
        while True:
            wait = min(
                period, membership.until_expiry(quorum.members) + _PAST_EXPIRY, deadline - time.monotonic()
            )
            if _wait_slice(stores, done_keys, wait):
                verdict = COMMIT
                break
            if store.check([key]):
                break  # someone decided already; read it below
            membership.refresh()
            gone = [
                n for n in quorum.members if not membership.alive(n) and not store.check([f"done/{a}/{n}"])
            ]
            if gone or time.monotonic() >= deadline:
                break
    return store.compare_set(key, "", verdict).decode() == COMMIT


def propose_next(stores: ElasticStores, membership: Membership, quorum: Quorum) -> None:
    """Right after ``quorum``'s attempt committed, decide the next attempt's quorum if nothing changed.

    Called by the quorum's lowest member (the one that would propose at the next boundary). When every
    member of ``quorum`` is alive and no other registered member is (nobody joined, nobody is waiting to
    get in), the next quorum is the same members, one step further, on the same group, with no state to
    send; deciding it now lets every member go from the commit straight to its next step without waiting for
    the others at the boundary (:func:`form_quorum` finds it decided). Otherwise nothing is proposed and the
    next boundary forms its quorum as usual.

    A member that dies or leaves after the commit is then in the next quorum: that attempt's reduction
    fails and it is aborted and re-run without it, as when a member dies inside a step.
    """
    membership.refresh_registry()
    live = membership.live()
    if sorted(live) != list(quorum.members):
        return
    nxt = Quorum(quorum.attempt + 1, quorum.members, quorum.step + 1, quorum.members[0], (), quorum.group)
    store = stores.store
    won = Quorum.from_json(store.compare_set(f"q/{nxt.attempt}", "", nxt.to_json()))
    if won == nxt:
        store.set("latest", str(nxt.attempt))
