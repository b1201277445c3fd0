"""Stage RPC wire format: tensors <-> streams of `Frame`s, with limits checked before anything is buffered.

Stream rules (see wire.proto): the first frame carries `CallMeta`; a frame with `tensor` starts a tensor; `data`
appends to the current tensor until it holds exactly `payload_bytes`. Large payloads are split into `chunk_bytes` pieces.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import AsyncIterable, Iterator
from dataclasses import dataclass, field

import torch

from swarm import wire_pb2 as pb
from swarm.compression import CODECS_BY_WIRE, DTYPE_TO_WIRE, WIRE_TO_DTYPE, Codec, CodecError, NoneCodec

PROTOCOL_VERSION = 1
CHUNK_BYTES = 2 << 20
GRPC_OPTIONS = [  # frames are at most CHUNK_BYTES plus a header; leave headroom
    ("grpc.max_send_message_length", 2 * CHUNK_BYTES),
    ("grpc.max_receive_message_length", 2 * CHUNK_BYTES),
]
SERVICE = "swarm.v1.Stage"


class WireError(ValueError):
    """A message that breaks the wire format or a limit; the server answers INVALID_ARGUMENT with this text."""


@dataclass
class EncodedTensor:
    header: pb.TensorHeader
    payload: bytes | bytearray

    @property
    def wire_bytes(self) -> int:
        return len(self.payload) + self.header.ByteSize()


def encode_tensor(name: str, t: torch.Tensor, codec: Codec) -> EncodedTensor:
    if t.dtype not in DTYPE_TO_WIRE:
        raise WireError(f"tensor {name!r}: dtype {t.dtype} cannot travel; use one of {list(DTYPE_TO_WIRE)}")
    if not t.is_floating_point() or t.numel() == 0:
        codec = NoneCodec()  # ids and labels travel exactly
    extra, payload = codec.encode(t)
    header = pb.TensorHeader(
        name=name, codec=codec.wire, dtype=DTYPE_TO_WIRE[t.dtype], shape=list(t.shape), payload_bytes=len(payload),
        **extra,
    )  # fmt: skip
    return EncodedTensor(header, payload)


def decode_tensor(enc: EncodedTensor, device: torch.device) -> torch.Tensor:
    try:
        return CODECS_BY_WIRE[enc.header.codec].decode(enc.header, enc.payload, device)
    except CodecError as e:
        raise WireError(str(e)) from e


def iter_frames(meta: pb.CallMeta, tensors: list[EncodedTensor], chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.Frame]:
    if not tensors:
        yield pb.Frame(meta=meta)
        return
    for i, enc in enumerate(tensors):
        view = memoryview(enc.payload)
        first = enc.payload if len(view) <= chunk_bytes else bytes(view[:chunk_bytes])
        yield pb.Frame(meta=meta if i == 0 else None, tensor=enc.header, data=first)
        for start in range(chunk_bytes, len(view), chunk_bytes):
            yield pb.Frame(data=bytes(view[start : start + chunk_bytes]))


@dataclass
class Limits:
    """What a receiver accepts, checked per header before its payload is buffered."""

    max_tensor_bytes: int
    allowed_names: frozenset[str]
    max_ndim: int = 4


@dataclass
class Call:
    meta: pb.CallMeta
    tensors: dict[str, EncodedTensor] = field(default_factory=dict)


def _check_header(h: pb.TensorHeader, limits: Limits, seen: dict) -> None:
    if h.name not in limits.allowed_names:
        raise WireError(f"unexpected tensor {h.name!r}; this call takes {sorted(limits.allowed_names)}")
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


async def read_call(frames: AsyncIterable[pb.Frame], limits: Limits) -> Call:
    """Assemble a request or response stream; raises WireError on anything malformed or over the limits."""
    call: Call | None = None
    current: pb.TensorHeader | None = None
    buf, filled = bytearray(), 0  # preallocated to the header's size (already checked against the limits)

    def finish() -> None:
        if current is not None:
            if filled != current.payload_bytes:
                raise WireError(
                    f"tensor {current.name!r}: got {filled} payload bytes, header says {current.payload_bytes}"
                )
            call.tensors[current.name] = EncodedTensor(current, buf)

    async for frame in frames:
        if call is None:
            if not frame.HasField("meta"):
                raise WireError("the first frame must carry CallMeta")
            if frame.meta.protocol_version != PROTOCOL_VERSION:
                raise WireError(f"protocol version {frame.meta.protocol_version} != {PROTOCOL_VERSION}")
            call = Call(meta=frame.meta)
        if frame.HasField("tensor"):
            finish()
            _check_header(frame.tensor, limits, call.tensors)
            current, buf, filled = frame.tensor, bytearray(frame.tensor.payload_bytes), 0
        if frame.data:
            if current is None:
                raise WireError("payload data before any tensor header")
            if filled + len(frame.data) > current.payload_bytes:
                raise WireError(
                    f"tensor {current.name!r}: payload longer than its header's {current.payload_bytes} bytes"
                )
            memoryview(buf)[filled : filled + len(frame.data)] = frame.data
            filled += len(frame.data)
    if call is None:
        raise WireError("empty stream")
    finish()
    return call


class WireStats:
    """Bytes on the wire per traffic class, next to what the same tensors would cost uncompressed (fp32 for floats)."""

    def __init__(self) -> None:
        self.wire_bytes: dict[str, int] = defaultdict(int)
        self.fp32_bytes: dict[str, int] = defaultdict(int)

    def add(self, traffic_class: str, enc: EncodedTensor) -> None:
        h = enc.header
        itemsize = 4 if WIRE_TO_DTYPE[h.dtype].is_floating_point else WIRE_TO_DTYPE[h.dtype].itemsize
        self.wire_bytes[traffic_class] += enc.wire_bytes
        self.fp32_bytes[traffic_class] += math.prod(h.shape) * itemsize + h.ByteSize()

    def as_dict(self) -> dict:
        return {
            "wire_bytes": sum(self.wire_bytes.values()),
            "fp32_bytes": sum(self.fp32_bytes.values()),
            "by_class": {k: {"wire": self.wire_bytes[k], "fp32": self.fp32_bytes[k]} for k in sorted(self.wire_bytes)},
        }
