"""The packet a process sends in a ``SyncBatchNorm`` exchange, and the checks every rank makes on it.

Every exchange of one layer call, forward or backward, whatever path the process took (no replicas, one
replica, several, an empty batch; the composite or the fused kernels), sends one float64 packet of the same
layout::

    packet = [ header: HEADER fields | slot A: width values | slot B: width values ]

    forward:  header (count, records, ordinal, ...)   A = mean_p           B = M2_p
    backward: header (ordinal, ...)                   A = sum_p(dy)        B = sum_p(dy * (x - mean))

Forward carries this process's count (in the header), mean and sum of squared deviations (M2) per channel.
Backward carries, per channel, the sums over this process's values of the upstream gradient ``dy`` of the
layer's output and of ``dy * (x - mean)`` with the whole batch's ``mean``: the two sums that
``torch.nn.SyncBatchNorm`` all-reduces, which torch's fused kernels produce and consume as they are
(``pc_sync._fused``), which a process without replicas reduces from its output gradient
(``pc_sync._unreplicated``), and into which a process with composite replicas turns its statistics'
gradient (``pc_sync._process_stats``). Summed over the ranks they give the input gradient of the whole
batch's batch norm on every rank, for the weight the layer has on every rank (as DDP keeps it).

**Why the header travels in the same collective.** A header that the ranks checked before sending the payload
would cost a second collective per exchange, about as much as the first (a small gloo ``all_gather``'s cost
is its round trip, not its bytes). Instead the packet's size never depends on the call: ``width`` is per
process group and the same on every rank, the widest layer the group has exchanged so far. A call whose
channels fit sends everything in one collective; the rest of its slots are zeros. A wider call sends its
header with empty slots, every rank reads every header, and only when they all agree do they widen the
group's ``width`` to that layer's channels and send again (once per new width in the group's life). So ranks
whose layers differ -- other channel counts, dtypes, forward against backward, a packet of another format --
always exchange packets of one size: the collective completes, and every rank raises the same
``ValueError`` from the same table instead of aborting inside gloo or summing unlike gradients.

``width`` and the call ordinal change only as a function of what the group's collectives returned, which is
the same on every rank, so they agree on every rank of a group; the state is kept per process-group object
(weakly: a new group starts afresh on every rank).

On CPU tensors both exchanges are ``all_gather`` calls (one gloo round where ``all_reduce`` takes two):
every rank reads every header at once. Backward on accelerators is an ``all_reduce`` (one kernel): its
headers are summed, and the sums and sums of squares of the checked fields prove equality; they are read at
the group's next forward exchange, which reads its own headers anyway, so backward adds no host
synchronization.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = [
    "HEADER",
    "GroupState",
    "StatisticsTable",
    "dtype_code",
    "exchange_gradients",
    "exchange_statistics_table",
    "group_size",
    "state_of",
]

_WIRE = torch.float64
HEADER = 16
"""Header fields at the start of every packet."""

_MAGIC = 1347616769.0  # "PS" and the format's version (1): a packet of another format differs here
_FORWARD, _BACKWARD = 1.0, 2.0
_ORDINAL_WRAP = 2**20  # ordinals stay exact in float64 sums of squares over any group size

# header fields
_F_MAGIC, _F_KIND, _F_CHANNELS, _F_DTYPE, _F_COUNT, _F_RECORDS, _F_ORDINAL, _F_REPLICAS, _F_WIDTH = range(9)
# their squares, for the checks of a summed (all-reduced) header
_SQUARED = {_F_KIND: 9, _F_CHANNELS: 10, _F_DTYPE: 11, _F_ORDINAL: 12}

_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def dtype_code(dtype: torch.dtype) -> int:
    """The header's number for an input dtype (0 for any other dtype)."""
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 0


def _dtype_name(code: float) -> str:
    index = int(code) - 1
    return str(_DTYPES[index]).replace("torch.", "") if 0 <= index < len(_DTYPES) else f"dtype #{code:g}"


def group_size(group: Any) -> int:
    """The number of processes in ``group`` (``None``: the default group); 1 without ``torch.distributed``.

    Raises:
        ValueError: If this process is not a member of ``group``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    size = dist.get_world_size(group)
    if size < 1:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of process_group {group!r}"
        )
    return size


@dataclass
class GroupState:
    """What this process knows about one process group's exchanges; the same on every rank of the group.

    Attributes:
        width: Channels per slot of every packet: the widest layer call the group has exchanged.
        ordinal: The number the group's next recording layer call gets (its backward carries it).
        unchecked: Summed backward headers on accelerators, each with the ordinal, channels and dtype code
            it expected; checked at the group's next forward exchange.
    """

    width: int = 0
    ordinal: int = 0
    unchecked: list[tuple[torch.Tensor, int, int, int]] = field(default_factory=list)


_states: weakref.WeakKeyDictionary[Any, GroupState] = weakref.WeakKeyDictionary()
_strong_states: dict[int, tuple[Any, GroupState]] = {}  # for group objects that take no weak reference
_states_lock = threading.Lock()


def state_of(group: Any) -> GroupState:
    """The exchange state of ``group`` (``None``: the default group), created empty on first use."""
    key = dist.group.WORLD if group is None else group
    with _states_lock:
        try:
            state = _states.get(key)
            if state is None:
                state = _states[key] = GroupState()
            return state
        except TypeError:  # not weakly referenceable: keep the object alive so that its id stays its own
            entry = _strong_states.get(id(key))
            if entry is None or entry[0] is not key:
                entry = _strong_states[id(key)] = (key, GroupState())
            return entry[1]


def _rank_and_peers(group: Any) -> tuple[int, list[int]]:
    rank = dist.get_rank(group)
    return rank, [r for r in range(dist.get_world_size(group)) if r != rank]


def _lost_peer(phase: str, group: Any, exc: BaseException) -> Exception:
    """A ``TimeoutError`` or ``ConnectionError`` naming the exchange, this rank and the peers it awaited."""
    rank, peers = _rank_and_peers(group)
    text = str(exc)
    message = (
        f"SyncBatchNorm: the {phase} exchange of batch statistics failed on rank {rank} while waiting for "
        f"rank(s) {peers} of its process group: a peer raised, died, or did not call this layer the same "
        f"way ({type(exc).__name__}: {text})"
    )
    if "timeout" in text.lower() or "timed out" in text.lower():
        return TimeoutError(message)
    return ConnectionError(message)


def _all_gather(packet: torch.Tensor, size: int, group: Any, phase: str) -> torch.Tensor:
    table = [torch.empty_like(packet) for _ in range(size)]
    try:
        dist.all_gather(table, packet, group=group)
    except RuntimeError as exc:
        raise _lost_peer(phase, group, exc) from exc
    return torch.stack(table)


def _all_reduce(packet: torch.Tensor, group: Any) -> None:
    try:
        dist.all_reduce(packet, op=dist.ReduceOp.SUM, group=group)
    except RuntimeError as exc:
        raise _lost_peer("backward", group, exc) from exc


def _header(kind: float, channels: int, code: int, ordinal: int, width: int, **extra: float) -> list[float]:
    head = [0.0] * HEADER
    head[_F_MAGIC] = _MAGIC
    head[_F_KIND] = kind
    head[_F_CHANNELS] = float(channels)
    head[_F_DTYPE] = float(code)
    head[_F_ORDINAL] = float(ordinal % _ORDINAL_WRAP)
    head[_F_WIDTH] = float(width)
    head[_F_COUNT] = extra.get("count", 0.0)
    head[_F_RECORDS] = extra.get("records", 0.0)
    head[_F_REPLICAS] = extra.get("replicas", 0.0)
    for f, sq in _SQUARED.items():
        head[sq] = head[f] * head[f]
    return head


def _packet(head: list[float], a: torch.Tensor, b: torch.Tensor, width: int) -> torch.Tensor:
    """``[head | a, zeros | b, zeros]`` in float64 on ``a``'s device (without ``a``, ``b`` if too wide).

    One ``cat``, which also widens ``a`` and ``b`` to float64; the padding is a cached constant.
    """
    channels = a.numel()
    header = torch.tensor(head, dtype=_WIRE).to(a.device, non_blocking=True)
    if channels > width:
        return torch.cat([header, _zeros(2 * width, a.device)])
    if channels == width:
        return torch.cat([header, a.reshape(-1), b.reshape(-1)])
    pad = _zeros(width - channels, a.device)
    return torch.cat([header, a.reshape(-1), pad, b.reshape(-1), pad])


# No lock: each dict operation is atomic under the GIL, and two threads that make the same pad at once only
# store equal, read-only zeros twice.
_pads: dict[tuple[int, torch.device], torch.Tensor] = {}


def _zeros(n: int, device: torch.device) -> torch.Tensor:
    """A float64 zero vector of ``n`` values on ``device``, made once (the packets' padding, read only)."""
    key = (n, device)
    pad = _pads.get(key)
    if pad is None:
        if len(_pads) >= 256:
            _pads.clear()
        pad = _pads[key] = torch.zeros(n, dtype=_WIRE, device=device)
    return pad


def _describe(heads: list[list[float]], ranks: list[int]) -> str:
    return "; ".join(
        f"rank {r}: {int(heads[r][_F_CHANNELS])} channels, {_dtype_name(heads[r][_F_DTYPE])}, "
        f"{_path(heads[r])}"
        for r in ranks
    )


def _path(head: list[float]) -> str:
    if head[_F_KIND] == _BACKWARD:
        return "in backward"
    replicas = int(head[_F_REPLICAS])
    return "no replicas" if replicas == 0 else f"{replicas} replica(s)"


def _disagree(heads: list[list[float]], f: int) -> bool:
    return len({h[f] for h in heads}) > 1


def _check_forward(heads: list[list[float]]) -> None:
    """Raise the same ``ValueError`` on every rank if the ranks' forward headers disagree."""
    ranks = list(range(len(heads)))
    foreign = [r for r in ranks if heads[r][_F_MAGIC] != _MAGIC]
    if foreign:
        raise ValueError(
            f"SyncBatchNorm: rank(s) {foreign} of the process group sent a packet of another format (another "
            "version of pc-sync, or another collective on this group at the same time): every rank must run "
            "the same pc-sync and reach this layer's exchange together"
        )
    if _disagree(heads, _F_KIND):
        backward = [r for r in ranks if heads[r][_F_KIND] == _BACKWARD]
        raise ValueError(
            f"SyncBatchNorm: rank(s) {backward} of the process group are in a layer's backward exchange "
            "while the others are in a forward exchange: every rank must run the same forward and backward"
        )
    if _disagree(heads, _F_CHANNELS) or _disagree(heads, _F_DTYPE):
        what = "channel counts" if _disagree(heads, _F_CHANNELS) else "input dtypes"
        raise ValueError(
            f"SyncBatchNorm: the ranks of the process group called one synchronized layer with different "
            f"{what} ({_describe(heads, ranks)}): every rank must call the same layers, in the same order, "
            "with inputs of the same dtype"
        )
    if _disagree(heads, _F_RECORDS):
        without = [r for r in ranks if not heads[r][_F_RECORDS]]
        raise ValueError(
            f"SyncBatchNorm: ranks {without} of the process group run this layer without autograd recording "
            "(no_grad, or an input that does not require grad) while the others record it; the backward "
            "exchange would wait forever. Run the same mode on every rank"
        )
    if _disagree(heads, _F_ORDINAL):
        counts = ", ".join(f"rank {r}: {int(heads[r][_F_ORDINAL])}" for r in ranks)
        raise ValueError(
            f"SyncBatchNorm: the ranks of the process group have made different numbers of recording layer "
            f"calls on it ({counts}): every rank must call the same layers in the same order"
        )


def _crossed(rank: int, ordinal: int, detail: str) -> RuntimeError:
    return RuntimeError(
        f"SyncBatchNorm: rank {rank}'s backward exchange for its layer call #{ordinal} met other layer calls "
        "on its peers: the processes ran the synchronized layers' backward in different orders (independent "
        "branches whose order autograd does not fix), so those gradients were wrong. Make the forward the "
        f"same on every rank, or join the branches in one layer ({detail})"
    )


def _check_backward(heads: list[list[float]], rank: int, ordinal: int) -> None:
    """Raise on every rank if the gathered backward headers are not all the same layer call's."""
    ranks = list(range(len(heads)))
    if any(h[_F_MAGIC] != _MAGIC or h[_F_KIND] != _BACKWARD for h in heads):
        others = [r for r in ranks if heads[r][_F_MAGIC] != _MAGIC or heads[r][_F_KIND] != _BACKWARD]
        raise _crossed(rank, ordinal, f"rank(s) {others} sent a forward packet or one of another format")
    for f in (_F_ORDINAL, _F_CHANNELS, _F_DTYPE):
        if _disagree(heads, f):
            calls = ", ".join(f"rank {r}: call #{int(heads[r][_F_ORDINAL])}" for r in ranks)
            raise _crossed(rank, ordinal, f"{calls}; {_describe(heads, ranks)}")


def _check_summed(summed: list[float], size: int, rank: int, ordinal: int, channels: int, code: int) -> None:
    """The check of an all-reduced backward header: sums and sums of squares prove the fields equal."""
    expected = _header(_BACKWARD, channels, code, ordinal, 0)
    if summed[_F_MAGIC] != _MAGIC * size:
        raise _crossed(rank, ordinal, "a peer sent a forward packet or one of another format")
    for f, sq in _SQUARED.items():
        if summed[f] != expected[f] * size or summed[sq] != expected[sq] * size:
            raise _crossed(rank, ordinal, "the summed headers of the ranks differ")


class StatisticsTable(NamedTuple):
    """What the forward exchange returns: every rank's count, and ``(mean, M2)`` rows, float64, in rank order.

    Attributes:
        counts: Every rank's count.
        payload: ``(R, 2, C)``: ``payload[r, 0]`` is rank ``r``'s mean, ``payload[r, 1]`` its M2.
        ordinal: This call's ordinal for its backward exchange (``None`` if not recording).
    """

    counts: list[int]
    payload: torch.Tensor
    ordinal: int | None

    @property
    def means(self) -> torch.Tensor:
        """``(R, C)`` every rank's mean."""
        return self.payload[:, 0]

    @property
    def m2s(self) -> torch.Tensor:
        """``(R, C)`` every rank's sum of squared deviations."""
        return self.payload[:, 1]


def _check_pending(state: GroupState, group: Any) -> None:
    pending, state.unchecked = state.unchecked, []
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    for summed, ordinal, channels, code in pending:
        _check_summed(summed.cpu().tolist(), size, rank, ordinal, channels, code)


def exchange_statistics_table(
    mean_p: torch.Tensor,
    m2_p: torch.Tensor,
    count_p: int,
    *,
    records: bool,
    replicas: int,
    dtype: torch.dtype,
    group: Any,
) -> StatisticsTable:
    """Gather every rank's ``(count, mean, M2)`` of one layer call: one ``all_gather`` (two when it widens).

    Collective: every member of ``group`` must call it for the same layer call, also with ``count_p == 0``.

    Args:
        mean_p: ``(C,)`` this process's per-channel mean (zeros for an empty batch).
        m2_p: ``(C,)`` its sum of squared deviations from ``mean_p``.
        count_p: Values per channel in this process's batch.
        records: Whether this rank will make the backward exchange of this call (autograd records it).
        replicas: The replicas this process ran the layer on (0 without replication), for error messages.
        dtype: The layer's input dtype on this rank.
        group: The process group (``None``: the default group).

    Returns:
        The gathered table, and this call's ordinal for its backward exchange (``None`` if not recording).

    Raises:
        ValueError: On every rank, if the ranks' calls differ (channels, dtype, forward against backward,
            autograd recording, call counts, packet format).
        RuntimeError: If an earlier backward exchange on an accelerator met another layer call (see module).
        ConnectionError: If a peer failed or left during the exchange.
        TimeoutError: If a peer did not reach the exchange within the group's timeout.
    """
    state = state_of(group)
    size = group_size(group)
    channels = mean_p.numel()
    while True:
        width = state.width
        head = _header(
            _FORWARD,
            channels,
            dtype_code(dtype),
            state.ordinal,
            width,
            count=float(count_p),
            records=float(records),
            replicas=float(replicas),
        )
        table = _all_gather(_packet(head, mean_p, m2_p, width), size, group, "forward")
        heads = table[:, :HEADER].cpu().tolist()
        _check_pending(state, group)
        _check_forward(heads)
        if channels <= width:
            break
        state.width = channels  # every rank sent the same channel count: every rank widens alike
    ordinal = None
    if records:
        ordinal = state.ordinal
        state.ordinal = (state.ordinal + 1) % _ORDINAL_WRAP
    counts = [int(h[_F_COUNT]) for h in heads]
    payload = table[:, HEADER:].view(table.size(0), 2, width)[:, :, :channels]
    return StatisticsTable(counts, payload, ordinal)


def exchange_gradients(
    sum_dy: torch.Tensor, sum_dy_xmu: torch.Tensor, *, ordinal: int, dtype: torch.dtype, group: Any
) -> torch.Tensor:
    """The sums over ``group`` of every rank's ``(sum(dy), sum(dy * (x - mean)))``: one collective.

    On CPU an ``all_gather`` summed in rank order (every rank gets bitwise the same sum) whose headers are
    checked at once; elsewhere an ``all_reduce`` whose summed header is checked at the group's next forward
    exchange.

    Args:
        sum_dy: ``(C,)`` this process's sum of the output gradient per channel.
        sum_dy_xmu: ``(C,)`` its sum of the output gradient times ``x - mean`` (the whole batch's mean).
        ordinal: The layer call's ordinal from its forward exchange.
        dtype: The layer's input dtype on this rank.
        group: The process group.

    Returns:
        ``(2, C)`` float64: the two sums of the whole batch.

    Raises:
        RuntimeError: On every rank (CPU), if the ranks sent different layer calls' gradients.
        ConnectionError: If a peer failed or left during the exchange.
        TimeoutError: If a peer did not reach the exchange within the group's timeout.
    """
    state = state_of(group)
    channels = sum_dy.numel()
    width = state.width
    if channels > width:  # the call's forward exchange widened the group to at least its channels
        raise RuntimeError(
            f"SyncBatchNorm: a backward exchange of {channels} channels on a process group whose exchanges "
            f"are {width} wide: its forward exchange was not made on this group"
        )
    code = dtype_code(dtype)
    packet = _packet(_header(_BACKWARD, channels, code, ordinal, width), sum_dy, sum_dy_xmu, width)
    if sum_dy.device.type == "cpu":
        table = _all_gather(packet, group_size(group), group, "backward")
        _check_backward(table[:, :HEADER].tolist(), dist.get_rank(group), ordinal)
        summed = table.sum(0)
    else:
        _all_reduce(packet, group)
        summed = packet
        state.unchecked.append((packet[:HEADER], ordinal % _ORDINAL_WRAP, channels, code))
    return summed[HEADER:].view(2, width)[:, :channels]
