"""Tensors on the wire: a tensor <-> (TensorHeader, payload) through a codec, and bytes counted per traffic class."""

from __future__ import annotations

import hashlib
import math
import threading
import warnings
from collections import defaultdict
from collections.abc import Mapping

import torch

from swarm.compression import (
    CODECS_BY_WIRE,
    DTYPE_TO_WIRE,
    WIRE_TO_DTYPE,
    Buffer,
    Codec,
    CodecContext,
    CodecError,
    NoneCodec,
)
from swarm.protocol import wire_pb2 as pb

CPU = torch.device("cpu")
FP16_MAX = 65504.0  # the default bound on activations and their gradients: what fp16 can carry


class WireError(ValueError):
    """A message that breaks the wire format or a limit; the server answers INVALID_ARGUMENT with this text."""


def check_values(x: torch.Tensor, name: str, bound: float) -> None:
    """Raises WireError unless every value of floating-point `x` is finite and within [-bound, bound]: a healthy
    activation or gradient never comes near the float32 limit, and one that does would overflow what it meets."""
    if x.numel() == 0 or not x.is_floating_point():
        return
    # NaN propagates to both ends; an inf is one of them. One read from the device, compared as Python floats: in x's
    # dtype the bound rounds (1e5 is inf in fp16, 65504 is 65536 in bf16)
    lo, hi = torch.stack(torch.aminmax(x)).tolist()
    if not (lo >= -bound and hi <= bound):
        raise WireError(f"{name} has values outside [-{bound:g}, {bound:g}] (min {lo:.3g}, max {hi:.3g}), or NaN")


class EncodedTensor:
    """A tensor as it travels: its header and payload bytes.

    A received payload stays in the pieces it came in (views into the frames gRPC handed over, or copies of small
    ones: swarm.protocol.frames `keep_payload`) until something reads `payload`, which joins them once: a receiver's
    event loop only collects pieces, and the one copy into contiguous memory happens where the tensor is decoded (a
    server's compute thread). A payload that is the values themselves (codec none, fp16) is checked in its pieces
    (check_encoded), and one whose pieces after the first came in frames of their own is sent on in those frames
    (`relay_frames`): a trainer relays a hidden state or gradient between stages copying its first piece only.

    Any thread may read it and join it (a join replaces the pieces by one payload; readers that took the pieces or
    frames before keep valid views: the bytes are the same either way); nothing writes to a payload."""

    __slots__ = ("header", "nbytes", "_payload", "_pieces", "_frames")

    def __init__(
        self,
        header: pb.TensorHeader,
        payload: Buffer | list[memoryview | bytearray],
        frames: tuple[bytes, ...] | None = None,
    ):
        """`frames`, with `payload` in pieces: the frames the pieces after the first are views into, one each, in
        order, each a frame of nothing but its `data` (encode_frame(data=piece)), as swarm.protocol.frames
        `read_call` finds them."""
        self.header = header
        self._payload: Buffer | None
        self._pieces: list[memoryview | bytearray] | None
        assert frames is None or (isinstance(payload, list) and len(frames) == len(payload) - 1)
        self._frames = frames
        if isinstance(payload, list):
            self._payload, self._pieces = None, payload
            self.nbytes = sum(len(piece) for piece in payload)
        else:
            self._payload, self._pieces = payload, None
            self.nbytes = len(payload)

    @property
    def payload(self) -> Buffer:
        pieces = self._pieces  # one read: another thread may join them meanwhile (then both join, alike)
        if pieces is None:
            assert self._payload is not None
            return self._payload
        # a bytearray: writable, so torch.frombuffer takes it without another copy. Set before the pieces go; the
        # frames go with them (held, they would keep a second copy of the payload)
        joined = pieces[0] if len(pieces) == 1 and isinstance(pieces[0], bytearray) else bytearray().join(pieces)
        self._payload = joined
        self._pieces = None
        self._frames = None
        return joined

    @property
    def joined(self) -> bool:
        """Whether the payload is in one piece of memory (received pieces are joined on first use of `payload`)."""
        return self._pieces is None

    @property
    def pieces(self) -> list[memoryview | bytearray] | None:
        """The payload in the pieces it came in; None once joined."""
        return self._pieces

    def relay_frames(self) -> tuple[memoryview | bytearray, tuple[bytes, ...]] | None:
        """(the payload's first piece, the frames of nothing but its data the other pieces came in), to send it on
        with only the first piece copied; None if it came otherwise (or was joined since)."""
        frames, pieces = self._frames, self._pieces  # read in the order `payload` clears them: both or neither
        return None if frames is None or pieces is None else (pieces[0], frames)

    @property
    def bytes_to_frame(self) -> int:
        """The payload bytes iter_frames copies to send this tensor."""
        relay = self.relay_frames()
        return self.nbytes if relay is None else len(relay[0])

    def renamed(self, header: pb.TensorHeader) -> EncodedTensor:
        """The same payload (in the same pieces and frames, nothing copied) under `header`."""
        pieces, frames = self._pieces, self._frames  # read before `payload`, which clears them in this order
        if pieces is None:
            return EncodedTensor(header, self.payload)
        return EncodedTensor(header, list(pieces), frames)

    def read(self, offset: int, n: int) -> bytes:
        """Up to `n` payload bytes from `offset`, read from the pieces without joining them."""
        pieces = self._pieces
        if pieces is None:
            assert self._payload is not None
            return bytes(memoryview(self._payload)[offset : offset + n])
        out = bytearray()
        for piece in pieces:
            if offset >= len(piece):
                offset -= len(piece)
                continue
            out += memoryview(piece)[offset : offset + n - len(out)]
            offset = 0
            if len(out) == n:
                break
        return bytes(out)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.header.shape)

    @property
    def wire_bytes(self) -> int:
        return self.nbytes + self.header.ByteSize()


FINGERPRINT_SAMPLES = 64  # windows of each payload a fingerprint reads, besides both ends
FINGERPRINT_WINDOW = 64  # bytes in each


def fingerprint(tensors: Mapping[str, EncodedTensor], key: bytes) -> bytes:
    """A digest of what a call sent, cheap at any size (a few KiB read): each tensor's header and size, both ends of
    its payload and FINGERPRINT_SAMPLES windows at offsets drawn from `key`, a secret of the receiver's, so that a
    sender cannot tell which bytes count. Two calls whose fingerprints match sent the same tensors but for a change
    that touches none of those windows, which a sender that knows neither the key nor the offsets makes by chance
    only (and then spoils only its own reply)."""
    digest = hashlib.sha256(key)
    for name in sorted(tensors):
        enc = tensors[name]
        digest.update(enc.header.SerializeToString(deterministic=True))
        digest.update(enc.nbytes.to_bytes(8, "little"))
        if enc.nbytes == 0:
            continue
        offsets = [0, max(enc.nbytes - FINGERPRINT_WINDOW, 0)]
        draw = hashlib.sha256(key + name.encode() + enc.nbytes.to_bytes(8, "little")).digest()
        while len(offsets) < 2 + FINGERPRINT_SAMPLES:
            for i in range(0, len(draw), 8):
                offsets.append(int.from_bytes(draw[i : i + 8], "little") % enc.nbytes)
            draw = hashlib.sha256(draw).digest()
        for offset in offsets[: 2 + FINGERPRINT_SAMPLES]:
            digest.update(enc.read(offset, FINGERPRINT_WINDOW))
    return digest.digest()


def encode_tensor(name: str, t: torch.Tensor, codec: Codec, ctx: CodecContext | None = None) -> EncodedTensor:
    if t.dtype not in DTYPE_TO_WIRE:
        raise WireError(f"tensor {name!r}: dtype {t.dtype} cannot travel; use one of {list(DTYPE_TO_WIRE)}")
    if not t.is_floating_point() or t.numel() == 0:
        codec = NoneCodec()  # ids and labels travel exactly
    params, payload = codec.encode(t, ctx)
    header = pb.TensorHeader(
        name=name,
        codec=codec.wire,  # type: ignore[arg-type]  # protobuf enums are ints at run time
        dtype=DTYPE_TO_WIRE[t.dtype],
        shape=list(t.shape),
        payload_bytes=len(payload),
        codec_params=params,
    )
    return EncodedTensor(header, payload)


def decode_tensor(enc: EncodedTensor, device: torch.device, ctx: CodecContext | None = None) -> torch.Tensor:
    try:
        return CODECS_BY_WIRE[enc.header.codec].decode(enc.header, enc.payload, device, ctx)
    except CodecError as e:
        raise WireError(str(e)) from e


# check_encoded reads received pieces where they lie, in read-only memory, which torch.frombuffer takes with a warning
# that writing to it is undefined; nothing here writes to it (the filter covers this module's calls alone)
warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning, r"swarm\.protocol\.tensors$")


def check_encoded(enc: EncodedTensor, name: str, bound: float, device: torch.device = CPU) -> torch.Tensor | None:
    """Raises WireError unless every value `enc` decodes to is finite and within [-bound, bound] (check_values), and
    its payload is well formed. A payload of the values themselves (codec none, fp16) still in the pieces it came in
    is read there: nothing is joined or copied. Otherwise decodes only where the codec cannot bound the values from
    the payload (8-bit can: no value exceeds its block's scale), and then returns the decoded tensor; else None."""
    pieces = enc.pieces
    if pieces is not None:
        try:
            dtype = CODECS_BY_WIRE[enc.header.codec].values_dtype(enc.header, enc.nbytes)
        except CodecError as e:
            raise WireError(str(e)) from e
        if dtype is not None and dtype.is_floating_point and all(len(p) % dtype.itemsize == 0 for p in pieces):
            for piece in pieces:
                if len(piece):
                    check_values(torch.frombuffer(piece, dtype=dtype), name, bound)
            return None
    return _checked(enc, name, bound, device)


def _checked(enc: EncodedTensor, name: str, bound: float, device: torch.device) -> torch.Tensor | None:
    """check_encoded on the joined payload: the decoded tensor where the codec cannot bound its values, else None."""
    codec = CODECS_BY_WIRE[enc.header.codec]
    try:
        known = codec.value_bound(enc.header, enc.payload)
        if known is None:
            decoded = codec.decode(enc.header, enc.payload, device)
            check_values(decoded, name, bound)
            return decoded
    except CodecError as e:
        raise WireError(str(e)) from e
    if not known <= bound:
        raise WireError(f"{name} has values outside [-{bound:g}, {bound:g}] (block scale up to {known:.3g})")
    return None


def decode_checked(enc: EncodedTensor, device: torch.device, name: str, bound: float) -> torch.Tensor:
    """decode_tensor, with its values checked as check_values does, in one pass over the data at most."""
    decoded = _checked(enc, name, bound, device)
    return decoded if decoded is not None else decode_tensor(enc, device)


def relayed(enc: EncodedTensor, name: str) -> EncodedTensor:
    """The same bytes under another tensor name (a reply's outputs become the next call's inputs): sent on as they came,
    never decoded and quantized again."""
    header = pb.TensorHeader()
    header.CopyFrom(enc.header)
    header.name = name
    return enc.renamed(header)


class WireStats:
    """Bytes on the wire per tensor role (swarm.compression.TensorRole), next to what the same tensors would cost
    uncompressed (fp32 for floats). Any thread may add and read: one lock guards both."""

    def __init__(self) -> None:
        self.wire_bytes: dict[str, int] = defaultdict(int)
        self.fp32_bytes: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def add(self, role: str, enc: EncodedTensor) -> None:
        h = enc.header
        itemsize = 4 if WIRE_TO_DTYPE[h.dtype].is_floating_point else WIRE_TO_DTYPE[h.dtype].itemsize
        with self._lock:
            self.wire_bytes[role] += enc.wire_bytes
            self.fp32_bytes[role] += math.prod(h.shape) * itemsize + h.ByteSize()

    def by_role(self) -> dict[str, tuple[int, int]]:
        """role -> (wire bytes, fp32 bytes)."""
        with self._lock:
            return {k: (self.wire_bytes[k], self.fp32_bytes[k]) for k in sorted(self.wire_bytes)}

    def as_dict(self) -> dict:
        roles = self.by_role()
        return {
            "wire_bytes": sum(w for w, _ in roles.values()),
            "fp32_bytes": sum(f for _, f in roles.values()),
            "by_role": {k: {"wire": w, "fp32": f} for k, (w, f) in roles.items()},
        }
