"""The frames of the c10d transport: their layout, and posting and receiving them on a pair's process group.

A frame is a fixed-size header, a uint8 tensor of :data:`HEADER_BYTES` sent with tag :data:`HEADER_TAG`,
followed by the frame's *body* when it is too large to ride inside the header (a uint8 tensor of its own with
tag :data:`PAYLOAD_TAG`), then by the message's *parts*, also with tag :data:`PAYLOAD_TAG`: a part of
:data:`PACK_MAX` bytes or more is a message of its own, smaller ones travel packed together (below). The
header starts with eight little-endian int64 words::

    magic | kind | sender rank | call id | aux | body bytes | flags | parts | inline body ...

``flags`` has bit 0 set when the body rides inside the header, and bit 1 when the frame's first message of
parts goes to the receive posted ahead for it (below).

The body is the parts' sizes (one int64 each) followed by the message's head (:class:`~.codec.Encoded`).
A part is a large tensor storage, sent from the tensor's own memory and received into memory that the
receiver's rebuilt tensor then owns (lent by :class:`~.memory.Buffers`, which gets it back once that
tensor is freed): neither side copies it. A size word with bit :data:`_STAGED` set is a part that the
receiver copies onto a CUDA device (the pinned host copy of a CUDA storage): it is received
into pinned memory, which torch's host allocator reuses from call to call, so the receive writes into pages
already there and the copy to the device runs at the bus's speed.

**Packs.** Every message of a frame after the header costs more than its bytes: its receive is posted only
once the header has arrived, so gloo's sender waits for the receiver's notification before it writes, and each
message is one more operation for both event loops and one more ``Work`` for Python. So consecutive parts
smaller than :data:`PACK_MAX` that are not staged share one message while it stays within :data:`PACK_MAX`
bytes: the sender copies them into one buffer, each at an offset aligned to :data:`PACK_ALIGN` bytes, and the
receiver receives the pack into one block of lent memory and gives each part a storage of its own over its
piece of it (the block comes back once the last of them is freed). Which parts share a pack follows from
their size words alone (:func:`packs`), so both ends agree without a word more in the frame. Copying a
mebibyte costs less than the message it saves (docs/distributed.md, "RPC backends", has the figures); larger
parts are not copied.

**Receives posted ahead.** Packing leaves one round trip per frame with parts: the first message of parts
cannot go before its receive is posted, and that is when the header has arrived. So once a frame with parts
has come, the receiver posts the receive of the next one's first message at once, with the size this one's
had, under :data:`PREDICTED_TAG`: the next frame whose first message has that size sends it there, and it goes
with the header, without waiting for a notification (a frame that repeats its sizes, as a training step's
gradients do, costs one message in flight, not a round trip more). Every receive still has the exact size of
the message it takes. Both ends know which size is posted from the frames they exchanged
(:func:`predicts`): it is that of the last frame whose first message could be posted ahead when no receive
of another size was waiting; a frame of another size goes as before, and its header says which it is. Only
host messages of at most :data:`PREDICT_MAX` bytes are posted ahead, so a link holds at most that much lent
memory waiting.

A small call (a few hundred bytes pickled) is one message each way instead of two: a gloo message costs a
notification round trip on top of its bytes, and a header of one kilobyte costs no more to move than one of
fifty bytes. Frames travel on a process group of two members, one per pair of transport members (the
transport's *link* to a peer), so the sender is known from the link it came on; the header still names the
sender's transport rank, which the receiver checks.

Every receive is posted with the exact size of the message it takes (gloo accepts a message shorter than the
receive posted for it, but the transport does not rely on that: a header is always :data:`HEADER_BYTES`).

Only host tensors are ever handed to gloo: its point-to-point ops read and write tensor memory from the host,
and a CUDA tensor makes its I/O thread fail in a way that aborts the process (:func:`check_host_tensor`).
The codec has already copied CUDA tensors to the host: their parts are host copies.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import torch

from pc_distributed.rpc._c10d.codec import Encoded
from pc_distributed.rpc._c10d.memory import Buffers, bytes_tensor, carve, host_view

__all__ = [
    "BYE",
    "CALL",
    "ERROR",
    "FETCH",
    "HEADER_BYTES",
    "HEADER_TAG",
    "KINDS",
    "PACK_ALIGN",
    "PACK_MAX",
    "PAYLOAD_TAG",
    "PING",
    "PREDICTED_TAG",
    "PREDICT_MAX",
    "RELEASE",
    "REMOTE",
    "REQUESTS",
    "VALUE",
    "Header",
    "HeaderReceive",
    "Incoming",
    "Posted",
    "Prediction",
    "check_host_tensor",
    "packs",
    "post_frame",
    "post_header",
    "post_prediction",
    "predicts",
    "receive_body",
    "receive_parts",
]

# Tags of the frames' messages on a link (any values work; these are recognisable in traces).
HEADER_TAG = 0x7C10
PAYLOAD_TAG = 0x7C11
PREDICTED_TAG = 0x7C12  # the first message of parts, sent to the receive posted ahead for it
HEADER_BYTES = 1024
_MAGIC = 0x5043_C10D  # the first word: a frame of this transport, in this layout
_WORDS = struct.Struct("<8q")
_SIZE = struct.Struct("<q")
_STAGED = 1 << 62  # in a part's size word: the part goes on to a CUDA device
_INLINE, _PREDICTED = 1, 2  # the header's flags
INLINE_MAX = HEADER_BYTES - _WORDS.size  # the largest body carried inside the header
PACK_MAX = 1 << 20
"""Parts smaller than this share messages of at most this many bytes (see the module docstring)."""
PACK_ALIGN = 64
"""Every part inside a pack starts at a multiple of this many bytes (aligned for any dtype)."""
PREDICT_MAX = 4 << 20
"""The largest first message of parts whose receive is posted ahead (see the module docstring)."""

# Kinds. Requests carry a pickled (fn, args, kwargs), or nothing; replies carry the call id they answer.
CALL = 1  # run fn, reply with its value
REMOTE = 2  # run fn, keep its value on the receiver under (sender, call id), reply with an empty value
FETCH = 3  # reply with the value kept under (sender, aux)
RELEASE = 4  # one way: drop the value kept under (sender, aux)
VALUE = 5  # reply: the pickled value (no body: None)
ERROR = 6  # reply: the pickled (exception, remote traceback text)
PING = 7  # one way: keep-alive
BYE = 8  # one way: the sender's last frame to the receiver
KINDS = frozenset(range(CALL, BYE + 1))
REQUESTS = frozenset((CALL, REMOTE, FETCH))


class Header(NamedTuple):
    """A received header: who sent what, how many body bytes follow (or came inline), how many parts."""

    kind: int
    src: int
    call_id: int
    aux: int
    nbytes: int  # of the body
    inline: memoryview | None  # the body, when it rode inside the header (a view of the header's bytes)
    nparts: int
    predicted: bool = False  # its first message of parts goes to the receive posted ahead


class Incoming(NamedTuple):
    """A received message: its body (a receive buffer, or a view of the header's bytes) and its parts."""

    body: torch.Tensor | memoryview
    parts: tuple[torch.Tensor, ...] = ()

    def head(self) -> memoryview:
        """The message's head: the body after the parts' sizes (no copy)."""
        return host_view(self.body)[_SIZE.size * len(self.parts) :]

    @classmethod
    def copy_of(cls, message: Encoded) -> Incoming:
        """What the receiver of ``message`` gets, made in this process.

        The head and the parts are copies, except the parts that are copies made for the message already.
        """
        body = memoryview(bytearray(_body(message)))
        return cls(body, tuple(p if i in message.staged else p.clone() for i, p in enumerate(message.parts)))


def _size_words(message: Encoded) -> list[int]:
    """The size word of each part of ``message``: its bytes, with :data:`_STAGED` set on staged parts."""
    return [p.numel() | (_STAGED if i in message.staged else 0) for i, p in enumerate(message.parts)]


def _body(message: Encoded) -> bytes:
    """The body of a frame carrying ``message``: its parts' sizes, then its head."""
    if not message.parts:
        return message.head
    return b"".join((*(_SIZE.pack(w) for w in _size_words(message)), message.head))


def packs(words: list[int]) -> list[list[int]]:
    """Which parts travel in which message, from the parts' size words (sender and receiver agree on it).

    Consecutive parts smaller than :data:`PACK_MAX` and not staged share a message while it stays within
    :data:`PACK_MAX` bytes, each starting at a multiple of :data:`PACK_ALIGN`; any other part is alone.

    Returns:
        The indices of the parts of each message, in order.
    """
    groups: list[list[int]] = []
    end = PACK_MAX  # where the open pack's bytes end (PACK_MAX: no pack open)
    for index, word in enumerate(words):
        size = word & ~_STAGED
        start = _aligned(end)
        if word & _STAGED or size >= PACK_MAX:
            groups.append([index])
            end = PACK_MAX
        elif start + size <= PACK_MAX:
            groups[-1].append(index)
            end = start + size
        else:
            groups.append([index])
            end = size
    return groups


def predicts(words: list[int], waiting: int | None) -> tuple[bool, int | None]:
    """Whether a frame's first message of parts goes to the receive posted ahead; what is posted after it.

    ``words`` are the frame's size words, ``waiting`` the bytes of the receive posted ahead (None: none is).
    The sender and the receiver call it on the same frames in the same order, so they agree.
    """
    span = _first_span(words)
    used = waiting is not None and span == waiting
    return used, waiting if waiting is not None and not used else span


def _first_span(words: list[int]) -> int | None:
    """The bytes of a frame's first message of parts, if its receive may be posted ahead (else None)."""
    if not words:
        return None
    first = packs(words)[0]
    if words[first[0]] & _STAGED:
        return None
    span = _offsets([words[i] for i in first])[1]
    return span if span <= PREDICT_MAX else None


def _aligned(offset: int) -> int:
    return -(-offset // PACK_ALIGN) * PACK_ALIGN


def _offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Where each of parts of ``sizes`` bytes starts in their pack, and the pack's bytes."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(_aligned(end))
        end = offsets[-1] + size
    return offsets, end


def _pack(parts: list[torch.Tensor]) -> torch.Tensor:
    """One uint8 tensor holding ``parts`` (contiguous uint8 host tensors) at their offsets in a pack.

    The gaps are zeros. The bytes are copied by memoryviews, holding the GIL: one tensor op (the pack's own
    creation) instead of two per part, each of which would let another thread take the GIL and this one wait
    for it to give it back (see :func:`~.memory.host_view`).
    """
    offsets, end = _offsets([p.numel() for p in parts])
    pack = torch.empty(end, dtype=torch.uint8)
    view = host_view(pack)
    filled = 0
    for part, offset in zip(parts, offsets, strict=True):
        view[filled:offset] = bytes(offset - filled)
        filled = offset + part.numel()
        view[offset:filled] = host_view(part)
    return pack


def check_host_tensor(tensor: object, what: str) -> torch.Tensor:
    """Check that ``tensor`` may be handed to a gloo point-to-point op and return it.

    gloo's point-to-point ops read and write the tensor's memory from the host; handed a CUDA tensor, gloo's
    I/O thread fails (``writev ... Bad address``) and the exception aborts the process. This check refuses
    such a tensor before it gets there; carry CUDA tensors inside a pickled head instead.

    Args:
        tensor: The tensor about to be sent or received.
        what: Names it in the error.

    Returns:
        ``tensor``.

    Raises:
        TypeError: If it is not a tensor.
        ValueError: If it is not a contiguous tensor in host memory.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(
            f"{what} must be a tensor in host memory, got one on {tensor.device}: gloo's point-to-point ops "
            "cannot carry it (the process would abort); send it inside a pickled message, which moves it "
            "through host memory"
        )
    if not tensor.is_contiguous():
        raise ValueError(f"{what} must be contiguous")
    return tensor


def _posted(work: Any) -> Any:
    """The ``Work`` of a point-to-point op of a link (a process group's ``send``/``recv`` always give one)."""
    if work is None:  # pragma: no cover - ProcessGroup.send/recv return a Work or raise
        raise RuntimeError("torch.distributed posted no operation")
    return work


class Posted(NamedTuple):
    """The sends of one frame, posted: keep it until :meth:`wait` returned (a dropped send is never made)."""

    works: list[Any]
    sent: tuple[Any, ...]  # the body's bytes and the packs, read by their sends until the sends are done
    predicted: int | None = None  # the size the receiver has posted ahead after this frame (see predicts)

    def wait(self) -> None:
        """Wait until every send of the frame is done (bounded by the link's timeout).

        The last send is waited for first: a link's sends are made in the order they were posted, so the
        others are done by then, and the thread wakes once per frame, not once per send.

        Raises:
            RuntimeError: torch's error if a send failed (the peer is gone, or the link timed out).
        """
        for work in reversed(self.works):
            work.wait()


def post_frame(
    group: Any,
    dst: int,
    kind: int,
    src: int,
    call_id: int,
    aux: int,
    message: Encoded | None,
    *,
    predicted: int | None = None,
) -> Posted:
    """Post the sends of one frame to rank ``dst`` of the link ``group``, without waiting for them.

    ``src`` is this member's rank in the transport (written into the header). ``predicted`` is the size that
    ``dst`` has posted ahead (:attr:`Posted.predicted` of the previous frame to it; None at first).

    The caller keeps ``message`` and the returned :class:`Posted` alive until its :meth:`~Posted.wait`
    returned: a dropped work's send is never performed, and a part is read from its tensor's memory until its
    send is done. Frames posted to one peer arrive in the order they were posted.

    Raises:
        RuntimeError: torch's error if the pair to ``dst`` is closed (its process died) or the group broke.
    """
    parts = () if message is None else message.parts
    words = [] if message is None else _size_words(message)
    used, after = predicts(words, predicted)
    body = None if message is None else _body(message)
    nbytes = 0 if body is None else len(body)
    inline = body is not None and nbytes <= INLINE_MAX
    flags = (_INLINE if inline else 0) | (_PREDICTED if used else 0)
    header = bytearray(HEADER_BYTES)
    _WORDS.pack_into(header, 0, _MAGIC, kind, src, call_id, aux, nbytes, flags, len(parts))
    if inline and body:
        header[_WORDS.size : _WORDS.size + nbytes] = body
    frame = check_host_tensor(torch.frombuffer(header, dtype=torch.uint8), "a frame header")
    works = [_posted(group.send([frame], dst, HEADER_TAG))]
    if body is not None and not inline:
        works.append(
            _posted(group.send([check_host_tensor(bytes_tensor(body), "a frame body")], dst, PAYLOAD_TAG))
        )
    sent: list[Any] = [] if body is None or inline else [body]
    for index, group_of in enumerate(packs(words)):
        if len(group_of) == 1:
            tensor = parts[group_of[0]]
        else:
            tensor = _pack([check_host_tensor(parts[i], "a message part") for i in group_of])
            sent.append(tensor)
        tag = PREDICTED_TAG if used and index == 0 else PAYLOAD_TAG
        works.append(_posted(group.send([check_host_tensor(tensor, "a message part")], dst, tag)))
    return Posted(works, tuple(sent), after)


class HeaderReceive(NamedTuple):
    """The receive of a link's next header, posted (:func:`post_header`): :meth:`take` it to wait for it."""

    frame: torch.Tensor  # over ``data``: written by gloo until the receive is done
    data: bytearray  # reused by the next header's receive once this one is taken (see post_header)
    work: Any

    def take(self) -> Header | str:
        """Wait for the header and read it.

        Blocks; gloo bounds the wait by the link's timeout, and ends it as soon as the peer's connection
        closes (its process died).

        Returns:
            The header, or a description of the bytes when they are not a header of this layout.

        Raises:
            RuntimeError: torch's error if the receive failed (the peer is gone, the link's timeout ran out).
        """
        self.work.wait()
        words = _WORDS.unpack_from(self.data)
        magic, kind, src, call_id, aux, nbytes, flags, nparts = words
        inline = flags & _INLINE
        if (
            magic != _MAGIC
            or kind not in KINDS
            or nbytes < _SIZE.size * nparts
            or nparts < 0
            or flags & ~(_INLINE | _PREDICTED)
            or (flags & _PREDICTED and not nparts)
            or (inline and nbytes > INLINE_MAX)
        ):
            return f"not a frame header: {list(words)}"
        # a copy (at most INLINE_MAX bytes): the header's memory receives the next header meanwhile
        body = memoryview(self.data[_WORDS.size : _WORDS.size + nbytes]) if inline else None
        return Header(kind, src, call_id, aux, nbytes, body, nparts, bool(flags & _PREDICTED))


def post_header(group: Any, src: int, taken: HeaderReceive | None = None) -> HeaderReceive:
    """Post the receive of the next header from rank ``src`` of the link ``group``, without waiting for it.

    ``taken``, a receive of the same link whose header was taken, lends its memory (a tensor op fewer per
    frame: each op releases the GIL, see :func:`~.memory.host_view`).

    The receive is announced to the peer as soon as it is posted, so a send that comes later goes out at once
    (one message). Headers and the rest of a frame travel under different tags, so the next header's receive
    may be posted while the current frame's body and parts are still to be received: a receiver that posts it
    before handing the frame on has it waiting in gloo while it hands on, and does not post it while the
    thread it just woke wants to run.

    Raises:
        RuntimeError: torch's error if the link is closed.
    """
    if taken is None:
        data = bytearray(HEADER_BYTES)
        frame = torch.frombuffer(data, dtype=torch.uint8)
    else:
        data, frame = taken.data, taken.frame
    return HeaderReceive(frame, data, _posted(group.recv([frame], src, HEADER_TAG)))


def receive_body(group: Any, src: int, nbytes: int, buffers: Buffers) -> torch.Tensor:
    """Receive the ``nbytes`` body that follows a header from rank ``src`` of the link (blocks, as above).

    The body lands in a buffer of ``buffers``; give it back once it is read.

    Raises:
        RuntimeError: torch's error if ``src`` died before sending it all, or the group broke.
    """
    body = buffers.take(nbytes)
    try:
        _posted(group.recv([body], src, PAYLOAD_TAG)).wait()
    except BaseException:
        buffers.give(body)
        raise
    return body


class Prediction(NamedTuple):
    """The receive of the first message of parts of a peer's next frame, posted ahead (:func:`predicts`)."""

    nbytes: int
    view: memoryview  # lent memory: the parts received into it get storages over pieces of it
    whole: torch.Tensor  # over ``view``: written by gloo until the receive is done
    work: Any


def post_prediction(group: Any, src: int, nbytes: int, memory: Buffers) -> Prediction:
    """Post the receive of ``nbytes`` ahead, under :data:`PREDICTED_TAG`, from rank ``src`` of the link.

    It lands in memory lent by ``memory``.

    Raises:
        RuntimeError: torch's error if the link is closed.
    """
    view = memory.lend_view(nbytes)
    whole = torch.frombuffer(view, dtype=torch.uint8)
    return Prediction(nbytes, view, whole, _posted(group.recv([whole], src, PREDICTED_TAG)))


def receive_parts(
    group: Any,
    src: int,
    body: torch.Tensor | memoryview,
    nparts: int,
    memory: Buffers,
    prediction: Prediction | None = None,
    predicted: bool = False,
) -> tuple[Incoming | str, Prediction | None]:
    """Receive the ``nparts`` parts that follow ``body`` from rank ``src`` of the link.

    ``prediction`` is the receive posted ahead on this link (None at first); ``predicted`` says whether the
    frame's header sends its first message of parts there.

    A part lands in memory lent by ``memory`` (:meth:`Buffers.lend`; a pack's parts in one block,
    :meth:`Buffers.lend_pieces`), which becomes the storage of the tensors it carries; a staged part lands in
    pinned memory (torch's host allocator keeps and reuses it).

    Every receive is posted before the first is waited for, so the parts stream one after the other.

    Returns:
        The message, or a description of the sizes when they are not sizes of parts (or do not match the
        receive posted ahead); and the receive posted ahead from now on.

    Raises:
        RuntimeError: torch's error if ``src`` died before sending them all, or the group broke.
    """
    if not nparts:
        return Incoming(body), prediction
    sizes_of = host_view(body)
    words = [_SIZE.unpack_from(sizes_of, _SIZE.size * i)[0] for i in range(nparts)]
    if min(words) <= 0 or min(w & ~_STAGED for w in words) <= 0:
        return f"not sizes of message parts: {words}", prediction
    used, after = predicts(words, None if prediction is None else prediction.nbytes)
    if used != predicted:
        return f"parts of {words} do not match the receive posted ahead for them ({prediction})", prediction
    # without CUDA the codec refuses a staged part, naming its device; host-only frames do not ask
    pinned = any(w & _STAGED for w in words) and torch.cuda.is_available()
    parts: list[torch.Tensor] = []
    works = []
    for index, group_of in enumerate(packs(words)):
        if used and index == 0 and prediction is not None:
            sizes = [words[i] for i in group_of]
            offsets, _ = _offsets(sizes)
            parts.extend(carve(prediction.view, list(zip(offsets, sizes, strict=True))))
            works.append(prediction.work)
            prediction = None
        elif len(group_of) == 1:
            word = words[group_of[0]]
            size = word & ~_STAGED
            whole = (
                torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
                if word & _STAGED
                else memory.lend(size)
            )
            parts.append(whole)
            works.append(_posted(group.recv([whole], src, PAYLOAD_TAG)))
            del whole
        else:
            sizes = [words[i] for i in group_of]
            offsets, end = _offsets(sizes)
            whole, pieces = memory.lend_pieces(end, list(zip(offsets, sizes, strict=True)))
            parts.extend(pieces)
            works.append(_posted(group.recv([whole], src, PAYLOAD_TAG)))
            del whole
    for work in reversed(works):  # the last one is done last: one wake-up for them all
        work.wait()
    if prediction is None and after is not None:
        prediction = post_prediction(group, src, after, memory)
    return Incoming(body, tuple(parts)), prediction
