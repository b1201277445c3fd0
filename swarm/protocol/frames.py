"""Stage RPC wire format: tensors <-> streams of `Frame`s, with limits checked before anything is buffered.

Stream rules (see wire.proto): the first frame carries `CallMeta`; a frame with `tensor` starts a tensor; `data`
appends to the current tensor until it holds exactly `payload_bytes`. Large payloads are split into `chunk_bytes` pieces.

On the wire every frame is a plain serialized `Frame`. Its `data` field is written and read by hand (encode_frame,
parse_frame) so that a payload is copied once on each side: into its frames by the sender, and out of them, where the
tensor is decoded, by the receiver (read_call keeps views into large frames, `keep_payload`); protobuf copies it on
every parse, access and serialize.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from swarm.compression import CODECS_BY_WIRE, WIRE_TO_DTYPE
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import CHUNK_BYTES, PROTOCOL_VERSION
from swarm.protocol.tensors import EncodedTensor, WireError

_DATA_KEY = 3 << 3 | 2  # Frame.data: field 3, wire type 2 (length-delimited)
# a received payload is kept as a view into its frame (`keep_payload`) if it is at least VIEW_MIN_BYTES and the rest of
# the frame (its other fields) at most FRAME_SLACK_BYTES; otherwise it is copied
VIEW_MIN_BYTES = 64 << 10
FRAME_SLACK_BYTES = 4 << 10


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_frame(
    meta: pb.CallMeta | None = None, tensor: pb.TensorHeader | None = None, data: bytes | memoryview = b""
) -> bytes:
    """The bytes of `pb.Frame(meta=meta, tensor=tensor, data=data).SerializeToString()`, with `data` copied once.

    Protobuf would copy the payload into the message and again out of it. Fields go in field-number order, as
    protobuf writes them, so the output is byte-identical to protobuf's (tests/unit/test_wire.py checks)."""
    head = b"" if meta is None and tensor is None else pb.Frame(meta=meta, tensor=tensor).SerializeToString()
    if not len(data):
        return head
    return b"".join((head, _varint(_DATA_KEY), _varint(len(data)), data))


def iter_frames(meta: pb.CallMeta, tensors: list[EncodedTensor], chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Serialized `Frame`s of one call: `meta` in the first, each tensor's header before its payload's chunks (the
    first in the header's frame: a frame of its own costs one more gRPC message, measured ~1 ms more per call).
    A payload that arrived here in frames is sent on in the frames it came in, all but its first piece (no copy:
    EncodedTensor.relay_frames)."""
    if not tensors:
        yield encode_frame(meta)
        return
    for i, enc in enumerate(tensors):
        relay = enc.relay_frames()
        head, frames = relay if relay is not None else (enc.payload, ())
        view = memoryview(head).cast("B")
        yield encode_frame(meta if i == 0 else None, enc.header, view[:chunk_bytes])
        for start in range(chunk_bytes, len(view), chunk_bytes):
            yield encode_frame(data=view[start : start + chunk_bytes])
        yield from frames


def _read_varint(view: memoryview, pos: int, max_bytes: int = 10) -> tuple[int, int] | None:
    """-> (value, position after it), or None if it is truncated or longer than `max_bytes`."""
    value = 0
    for i in range(min(max_bytes, len(view) - pos)):
        byte = view[pos + i]
        value |= (byte & 0x7F) << (7 * i)
        if byte < 0x80:
            return value, pos + i + 1
    return None


def _split_data(view: memoryview) -> tuple[memoryview, list[memoryview]] | None:
    """Scan a serialized Frame's top-level fields -> (the last `data` field's bytes, every other field's bytes).

    None for what this scan does not handle (groups, bad tags or wire types, truncation): protobuf gets those whole."""
    data, rest, pos = view[:0], [], 0
    while pos < len(view):
        start = pos
        if (read := _read_varint(view, pos, max_bytes=5)) is None:
            return None
        key, pos = read
        if not 1 <= key >> 3 < 1 << 29:
            return None
        wire_type = key & 7
        if wire_type == 0:
            if (read := _read_varint(view, pos)) is None:
                return None
            pos = read[1]
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            if (read := _read_varint(view, pos, max_bytes=5)) is None:
                return None
            length, pos = read
            pos += length
        else:
            return None
        if pos > len(view):
            return None
        if key == _DATA_KEY:
            data = view[pos - length : pos]  # a later `data` replaces an earlier one, as protobuf does
        else:
            rest.append(view[start:pos])
    return data, rest


def parse_frame(raw: bytes) -> tuple[pb.Frame, memoryview]:
    """A serialized Frame -> (the Frame without its `data`, a view of `data` inside `raw`); raises WireError.

    Protobuf would copy the payload on parse and again on every `frame.data` access; here it is not copied at all.
    Every field but `data` is parsed by protobuf (concatenated serialized fields merge like one message), so nested
    messages, unknown fields and malformed input fare exactly as with `pb.Frame.FromString(raw)`."""
    view = memoryview(raw).cast("B")
    split = _split_data(view)
    try:
        if split is None:
            frame = pb.Frame.FromString(raw)
            data = memoryview(frame.data)
            frame.ClearField("data")
        else:
            data, rest = split
            frame = pb.Frame.FromString(b"".join(rest))
    except DecodeError as e:
        raise WireError(f"malformed frame: {e}") from e
    return frame, data


@dataclass
class Limits:
    """What a receiver accepts, checked per header before its payload is buffered."""

    max_tensor_bytes: int
    allowed_names: frozenset[str]
    max_ndim: int = 4

    @property
    def frame_bytes(self) -> int:
        """The most payload one frame of such a call carries: a chunk, or a whole tensor's (_check_header's bound)."""
        return min(CHUNK_BYTES, 2 * max(self.max_tensor_bytes, 64))


@dataclass
class Call:
    meta: pb.CallMeta
    tensors: dict[str, EncodedTensor] = field(default_factory=dict)
    reserved: int = 0  # payload bytes taken from the receiver's ByteBudget; give them back when done with the call
    caller: str = ""  # whom `reserved` was taken for


class Busy(Exception):
    """The receiver holds as many request bytes as it accepts: RESOURCE_EXHAUSTED, the caller tries another peer."""


ADDRESS_SHARE_FACTOR = 2.0  # the callers of one address together hold at most this many callers' shares


def address_of(caller: str) -> str:
    """The address a caller calls from: "ipv4:203.0.113.7" of the connection "ipv4:203.0.113.7:51234"; a libp2p
    caller ("p2p:<its id>", authenticated by libp2p) is its own."""
    if caller.startswith(("ipv4:", "ipv6:")) and caller.count(":") >= 2:
        return caller.rsplit(":", 1)[0]
    return caller


class ByteBudget:
    """Payload bytes a receiver holds at once, across all its calls and per caller: a flood is refused instead of
    growing memory. One caller (a connection, or a libp2p peer) holds at most `caller_share` of the limit, so others
    still get in, and the callers of one address together ADDRESS_SHARE_FACTOR times that: peers behind one NAT or
    relay do not pay for each other, and one host opening many connections holds no more than two callers' share."""

    def __init__(self, limit: int, caller_share: float = 1.0):
        self.limit, self.used, self.caller_share = limit, 0, caller_share
        self.by_caller: dict[str, int] = {}
        self.by_address: dict[str, int] = {}
        self.arrived = 0  # payload bytes that arrived, held or refused (server/heap.py trims after enough)

    def take(self, n: int, caller: str = "") -> None:
        """Hold `n` payload bytes that arrived from `caller`; raises Busy (holding nothing more) beyond the limits."""
        self.arrived += n
        self.reserve(n, caller)

    def reserve(self, n: int, caller: str = "") -> None:
        """Hold `n` bytes for what `caller` is about to send (the next frame read from its stream); raises Busy."""
        if self.used + n > self.limit:
            raise Busy(f"busy: {self.used / 2**20:.1f} MiB of requests held, the limit is {self.limit / 2**20:.1f} MiB")
        held, address = self.by_caller.get(caller, 0), address_of(caller)
        if held + n > self.limit * self.caller_share:
            most = self.limit * self.caller_share / 2**20
            raise Busy(
                f"busy: this caller holds {held / 2**20:.1f} MiB of requests, one caller may hold {most:.1f} MiB"
            )
        from_address = self.by_address.get(address, 0)
        if from_address + n > self.limit * min(1.0, ADDRESS_SHARE_FACTOR * self.caller_share):
            raise Busy(f"busy: the callers of this address hold {from_address / 2**20:.1f} MiB of requests")
        self.used += n
        self.by_caller[caller] = held + n
        self.by_address[address] = from_address + n

    def release(self, n: int, caller: str = "") -> None:
        self.used -= n
        for counts, key in ((self.by_caller, caller), (self.by_address, address_of(caller))):
            left = counts.pop(key, 0) - n
            if left > 0:
                counts[key] = left


def _check_header(h: pb.TensorHeader, limits: Limits, seen: dict) -> None:
    if h.name not in limits.allowed_names:
        name = h.name if len(h.name) <= 40 else f"{h.name[:40]}... ({len(h.name)} characters)"
        raise WireError(f"unexpected tensor {name!r}; this call takes {sorted(limits.allowed_names)}")
    if h.name in seen:
        raise WireError(f"tensor {h.name!r} sent twice")
    if h.codec not in CODECS_BY_WIRE:
        raise WireError(f"tensor {h.name!r}: unknown codec {h.codec}")
    if h.dtype not in WIRE_TO_DTYPE:
        raise WireError(f"tensor {h.name!r}: unknown dtype {h.dtype}")
    if not 1 <= len(h.shape) <= limits.max_ndim or any(d < 0 for d in h.shape):
        raise WireError(f"tensor {h.name!r}: bad shape {list(h.shape)}")
    raw_bytes = math.prod(h.shape) * WIRE_TO_DTYPE[h.dtype].itemsize
    if raw_bytes > limits.max_tensor_bytes or not 0 <= h.payload_bytes <= max(raw_bytes, 64) * 2:
        raise WireError(
            f"tensor {h.name!r} of shape {list(h.shape)} ({raw_bytes} bytes, payload {h.payload_bytes}) exceeds the "
            f"limit of {limits.max_tensor_bytes} bytes"
        )


MAX_META_STRING = 128  # characters of a CallMeta string (ids, codec names)
MAX_SIGNATURE_BYTES = 1024  # an RSA-2048 signature is 256


def _check_meta(meta: pb.CallMeta) -> None:
    """Strings a receiver may echo or log, and signatures it may verify, are short."""
    for name in ("microbatch_id", "reply_codec_name", "admitted_by"):
        if len(getattr(meta, name)) > MAX_META_STRING:
            raise WireError(f"CallMeta.{name} is over {MAX_META_STRING} characters")
    if len(meta.admission_signature) > MAX_SIGNATURE_BYTES:
        raise WireError(f"CallMeta.admission_signature is over {MAX_SIGNATURE_BYTES} bytes")


async def read_call(
    frames: AsyncIterable[bytes | pb.Frame],
    limits: Limits,
    budget: ByteBudget | None = None,
    caller: str = "",
    idle_timeout: float | None = None,
    on_meta: Callable[[pb.CallMeta], None] | None = None,
) -> Call:
    """Assemble a request or response stream; raises WireError on anything malformed or over the limits, Busy when
    `budget` has no room for its payload or for the next frame before it is read, or none left for `caller` (then it
    holds nothing of it; on success it holds `Call.reserved`), TimeoutError when no frame arrives for `idle_timeout`
    seconds. `on_meta(meta)` runs once the CallMeta has passed the checks here, before any payload is held: what it
    raises ends the read.

    Frames are serialized, as they come off the wire (no payload is copied here: each tensor keeps views into its
    frames, joined where it is decoded), or already parsed `pb.Frame`s."""
    call: Call | None = None
    current: pb.TensorHeader | None = None
    # the current tensor's payload as it arrives, views into the frames (EncodedTensor joins them off the event loop):
    # up to the header's size (checked against the limits), so a header that declares a large tensor and sends
    # nothing holds nothing
    pieces: list[memoryview | bytearray] = []
    # the frames of its pieces after the first while each held nothing but its piece, kept as it came
    # (EncodedTensor.relay_frames: sent on as they came)
    bare: list[bytes] | None = None
    got = 0
    taken = 0
    # held for the frame being read: gRPC receives a stream's next message into memory once it is asked for, so the
    # budget covers the streams being read, not only the payloads they hold
    read_ahead = 0

    def before_read() -> None:  # nothing is reserved now: each frame's arrival gave its reservation back
        nonlocal read_ahead
        if budget is not None:
            budget.reserve(limits.frame_bytes, caller)
            read_ahead = limits.frame_bytes

    def finish() -> None:
        if current is not None:
            assert call is not None  # a tensor header is only accepted after the CallMeta
            if got != current.payload_bytes:
                raise WireError(
                    f"tensor {current.name!r}: got {got} payload bytes, header says {current.payload_bytes}"
                )
            call.tensors[current.name] = EncodedTensor(current, pieces, tuple(bare) if bare else None)

    try:
        async for message in _within(frames, idle_timeout, before_read):
            if budget is not None:
                budget.release(read_ahead, caller)
                read_ahead = 0
            if isinstance(message, pb.Frame):
                frame, data = message, memoryview(message.data)
            else:
                frame, data = parse_frame(message)
            if call is None:
                if not frame.HasField("meta"):
                    raise WireError("the first frame must carry CallMeta")
                if frame.meta.protocol_version != PROTOCOL_VERSION:
                    raise WireError(f"protocol version {frame.meta.protocol_version} != {PROTOCOL_VERSION}")
                _check_meta(frame.meta)
                if on_meta is not None:
                    on_meta(frame.meta)
                call = Call(meta=frame.meta)
            if frame.HasField("tensor"):
                finish()
                _check_header(frame.tensor, limits, call.tensors)
                current, pieces, bare, got = frame.tensor, [], [], 0
            if len(data):
                if current is None:
                    raise WireError("payload data before any tensor header")
                if got + len(data) > current.payload_bytes:
                    raise WireError(
                        f"tensor {current.name!r}: payload longer than its header's {current.payload_bytes} bytes"
                    )
                if budget is not None:
                    budget.take(len(data), caller)
                    taken += len(data)
                keep_payload(pieces, data, len(data) if isinstance(message, pb.Frame) else len(message))
                if bare is not None and len(pieces) > 1:  # each piece after the first: a frame of its own?
                    # (of at most a chunk: a larger one, which a libp2p message can carry, would not go out over gRPC)
                    fits = len(data) <= CHUNK_BYTES
                    if isinstance(message, bytes) and fits and pieces[-1] is data and _holds_only(message, data):
                        bare.append(message)
                    else:
                        bare = None
                got += len(data)
            del message, frame, data  # not held while waiting for the next (the pieces hold what is kept)
        if call is None:
            raise WireError("empty stream")
        finish()
    except BaseException:
        if budget is not None:
            budget.release(taken + read_ahead, caller)
        raise
    if budget is not None:
        budget.release(read_ahead, caller)
    call.reserved, call.caller = taken, caller
    return call


def _holds_only(raw: bytes, data: memoryview) -> bool:
    """Whether serialized frame `raw` is `data` and nothing else, as encode_frame(data=data) writes it."""
    head = _varint(_DATA_KEY) + _varint(len(data))
    return len(raw) == len(head) + len(data) and raw.startswith(head)


def keep_payload(pieces: list[memoryview | bytearray], data: memoryview, frame_bytes: int) -> None:
    """Adds a frame's payload `data` to a tensor's pieces: a view into the frame (which it keeps alive) if the payload
    is most of a large frame, else a copy onto the last piece. The budget counts payload bytes: a frame that carried
    little payload beside other fields, or many tiny frames each held as an object, would hold far more than it."""
    if len(data) >= VIEW_MIN_BYTES and frame_bytes - len(data) <= FRAME_SLACK_BYTES:
        pieces.append(data)
    elif pieces and isinstance(pieces[-1], bytearray):
        pieces[-1] += data
    else:
        pieces.append(bytearray(data))


async def _within(frames: AsyncIterable, idle_timeout: float | None, before: Callable[[], None]) -> AsyncIterator:
    """`frames`, each within `idle_timeout` seconds of the one before (None: no limit); raises TimeoutError. Calls
    `before()` before it asks for each frame."""
    it, end = aiter(frames), object()
    while True:
        before()
        # the end comes as a value, not StopAsyncIteration: wait_for's task would keep that exception, and with it
        # this frame and the last payload, in a cycle only the garbage collector frees
        frame = await (anext(it, end) if idle_timeout is None else asyncio.wait_for(anext(it, end), idle_timeout))
        if frame is end:
            return
        yield frame
        del frame  # not held while waiting for the next
