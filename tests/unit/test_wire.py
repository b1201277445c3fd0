"""The hand-written Frame encoder and parser (swarm.protocol.frames) against protobuf's own serializer and parser.

They exist to copy each payload once instead of several times; these tests pin that the bytes stay plain `Frame`
protobuf both ways, so that peers with either implementation interoperate."""

import asyncio
import itertools
import random

import pytest
import torch
from google.protobuf.message import DecodeError

from swarm.compression import get_codec
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.drain import Drains
from swarm.protocol.frames import (
    Busy,
    ByteBudget,
    Limits,
    _varint,
    encode_frame,
    iter_frames,
    parse_frame,
    read_call,
)
from swarm.protocol.rpc import PROTOCOL_VERSION
from swarm.protocol.tensors import WireError, decode_tensor, encode_tensor

META = pb.CallMeta(protocol_version=PROTOCOL_VERSION, microbatch_id="mb-7", stage=2, reply_codec=pb.CODEC_FLOAT16)
HEADER = pb.TensorHeader(name="inputs", codec=pb.CODEC_NONE, dtype=pb.DTYPE_FLOAT32, shape=[2, 3, 4], payload_bytes=96)
# 127/128 and 16383/16384 are where the length varint grows a byte; 2 MiB is CHUNK_BYTES
DATA_SIZES = [0, 1, 127, 128, 16383, 16384, 2 << 20]


def _data(n: int) -> bytes:
    return random.Random(n).randbytes(n)


def _field(number: int, wire_type: int, body: bytes) -> bytes:
    return _varint(number << 3 | wire_type) + body


def _len_field(number: int, body: bytes) -> bytes:
    return _field(number, 2, _varint(len(body)) + body)


def _protobuf_parse(raw: bytes) -> tuple[pb.Frame, bytes]:
    """What parse_frame must return, computed by protobuf: the frame without `data`, and `data`."""
    frame = pb.Frame.FromString(raw)
    data = frame.data
    frame.ClearField("data")
    return frame, data


def _assert_parses_like_protobuf(raw: bytes) -> None:
    """Same result as protobuf, or WireError exactly where protobuf raises DecodeError."""
    try:
        expected = _protobuf_parse(raw)
    except DecodeError:
        with pytest.raises(WireError, match="malformed frame"):
            parse_frame(raw)
        return
    frame, data = parse_frame(raw)
    assert frame == expected[0]  # message equality includes unknown fields
    assert frame.SerializeToString() == expected[0].SerializeToString()
    assert bytes(data) == expected[1]


@pytest.mark.parametrize("n", DATA_SIZES)
@pytest.mark.parametrize("parts", ["meta+tensor", "tensor", "meta", "none"])
def test_encode_frame_is_protobufs_serialization(parts, n):
    meta = META if "meta" in parts else None
    tensor = HEADER if "tensor" in parts else None
    data = _data(n)
    expected = pb.Frame(meta=meta, tensor=tensor, data=data).SerializeToString()
    assert encode_frame(meta, tensor, data) == expected
    assert encode_frame(meta, tensor, memoryview(data)) == expected  # how iter_frames passes payload chunks
    assert pb.Frame.FromString(expected) == pb.Frame(meta=meta, tensor=tensor, data=data)


@pytest.mark.parametrize("n", DATA_SIZES)
@pytest.mark.parametrize("parts", ["meta+tensor", "tensor", "meta", "none"])
def test_parse_frame_reads_protobufs_serialization(parts, n):
    frame = pb.Frame(
        meta=META if "meta" in parts else None, tensor=HEADER if "tensor" in parts else None, data=_data(n)
    )
    parsed, data = parse_frame(frame.SerializeToString())
    assert isinstance(data, memoryview) and bytes(data) == frame.data
    frame.ClearField("data")
    assert parsed == frame


def test_parse_frame_does_not_copy_the_payload():
    raw = encode_frame(META, HEADER, _data(1000))
    _, data = parse_frame(raw)
    assert data.obj is raw


@pytest.mark.parametrize("order", list(itertools.permutations(["meta", "tensor", "data"])))
def test_fields_in_any_order(order):
    """Protobuf writes fields in number order but must accept any order; a frame is the merge of its fields."""
    pieces = {
        "meta": pb.Frame(meta=META).SerializeToString(),
        "tensor": pb.Frame(tensor=HEADER).SerializeToString(),
        "data": pb.Frame(data=_data(300)).SerializeToString(),
    }
    raw = b"".join(pieces[name] for name in order)
    _assert_parses_like_protobuf(raw)
    frame, data = parse_frame(raw)
    assert frame == pb.Frame(meta=META, tensor=HEADER) and bytes(data) == _data(300)


def test_repeated_fields_merge_like_protobuf():
    """A repeated `data` replaces the earlier one; repeated messages merge field by field."""
    raw = b"".join(
        [
            pb.Frame(data=b"first", meta=pb.CallMeta(stage=1, microbatch_id="a")).SerializeToString(),
            pb.Frame(data=b"second", meta=pb.CallMeta(stage=5)).SerializeToString(),
        ]
    )
    _assert_parses_like_protobuf(raw)
    frame, data = parse_frame(raw)
    assert bytes(data) == b"second" and (frame.meta.stage, frame.meta.microbatch_id) == (5, "a")


@pytest.mark.parametrize(
    "unknown",
    [
        _field(15, 0, _varint(2**40)),  # varint
        _field(16, 1, b"8 bytes!"),  # fixed64
        _len_field(17, b"a newer peer's field"),
        _field(18, 5, b"4byt"),  # fixed32
        _field(1000, 0, b"\x01"),  # two-byte tag
        _field(19, 3, _field(1, 0, b"\x05")) + _field(19, 4, b""),  # a group: handed to protobuf whole
        _field(3, 0, b"\x07"),  # `data`'s number with the wrong wire type: protobuf keeps it as an unknown field
    ],
    ids=["varint", "fixed64", "bytes", "fixed32", "long tag", "group", "data as varint"],
)
def test_unknown_fields_are_kept_and_ignored(unknown):
    """Old and new peers interoperate: fields this version does not know parse as they do in protobuf."""
    frame = pb.Frame(meta=META, tensor=HEADER, data=_data(96))
    for raw in (unknown + frame.SerializeToString(), frame.SerializeToString() + unknown):
        _assert_parses_like_protobuf(raw)
        parsed, data = parse_frame(raw)
        assert parsed.meta == META and parsed.tensor == HEADER


def test_non_canonical_varints_parse_like_protobuf():
    for tag_bytes in range(1, 7):  # protobuf reads tags and lengths of up to 5 bytes
        tag = b"\x9a" + b"\x80" * (tag_bytes - 2) + b"\x00" if tag_bytes > 1 else b"\x1a"
        for length_bytes in range(1, 7):
            length = b"\x82" + b"\x80" * (length_bytes - 2) + b"\x00" if length_bytes > 1 else b"\x02"
            _assert_parses_like_protobuf(tag + length + b"ab")


def test_truncated_frames_are_rejected():
    raw = encode_frame(META, HEADER, _data(96))
    for end in range(len(raw)):
        _assert_parses_like_protobuf(raw[:end])
    with pytest.raises(WireError):
        parse_frame(raw[:-1])  # cut inside `data`
    with pytest.raises(WireError):
        parse_frame(raw[:3])  # cut inside `meta`


def test_garbage_is_rejected_like_protobuf():
    rng = random.Random(0)
    valid = encode_frame(META, HEADER, _data(64))
    cases = [b"\xff\x00garbage\x13\x37" * 10, b"\x00", b"\x07\x01", b"\x1a", b"\x1a\x05ab", b"\x0a\x03\xff\xff\xff"]
    cases += [rng.randbytes(rng.randrange(1, 40)) for _ in range(300)]
    for _ in range(300):  # flip one byte of a valid frame
        i = rng.randrange(len(valid))
        cases.append(valid[:i] + bytes([rng.randrange(256)]) + valid[i + 1 :])
    rejected = 0
    for raw in cases:
        _assert_parses_like_protobuf(raw)
        try:
            parse_frame(raw)
        except WireError:
            rejected += 1
    assert rejected > len(cases) // 4  # the cases do exercise rejection


async def _stream(items):
    for item in items:
        yield item


def test_read_call_reassembles_serialized_frames():
    x, ids = torch.randn(300, 70), torch.randint(0, 1000, (7, 9))
    tensors = [encode_tensor("inputs", x, get_codec("none")), encode_tensor("labels", ids, get_codec("none"))]
    frames = list(iter_frames(META, tensors, chunk_bytes=10_000))
    assert len(frames) > 5 and all(isinstance(f, bytes) for f in frames)
    limits = Limits(max_tensor_bytes=1 << 20, allowed_names=frozenset({"inputs", "labels"}))
    for stream in (frames, [pb.Frame.FromString(f) for f in frames]):  # off the wire, or parsed by protobuf
        call = asyncio.run(read_call(_stream(stream), limits))
        assert call.meta == META
        assert torch.equal(decode_tensor(call.tensors["inputs"], torch.device("cpu")), x)
        assert torch.equal(decode_tensor(call.tensors["labels"], torch.device("cpu")), ids)


def test_read_call_rejects_malformed_serialized_frames():
    limits = Limits(max_tensor_bytes=1 << 20, allowed_names=frozenset({"inputs"}))
    x = encode_tensor("inputs", torch.randn(10, 10), get_codec("none"))
    good = list(iter_frames(META, [x], chunk_bytes=100))
    cases = [
        ("malformed frame", [good[0], b"\xff\x00garbage"]),
        ("malformed frame", [good[0][:-1]]),  # truncated inside its data
        ("longer", [*good, encode_frame(data=b"xx")]),
        ("got 300", good[:-1]),
        ("before any tensor", [encode_frame(META), encode_frame(data=b"xx")]),
        ("first frame", [encode_frame(tensor=x.header, data=b"xx")]),
        ("empty stream", []),
    ]
    for match, frames in cases:
        with pytest.raises(WireError, match=match):
            asyncio.run(read_call(_stream(frames), limits))


def test_a_caller_holds_at_most_its_share_of_the_byte_budget():
    budget = ByteBudget(limit=100, caller_share=0.5)
    budget.take(50, "ipv4:203.0.113.7")
    with pytest.raises(Busy, match="this caller"):
        budget.take(1, "ipv4:203.0.113.7")
    budget.take(50, "ipv6:[2001:db8::1]")  # another caller still gets in
    with pytest.raises(Busy, match="MiB of requests held"):
        budget.take(1, "ipv4:198.51.100.1")
    assert budget.arrived == 102  # refused bytes arrived too (server/heap.py trims after enough)
    budget.release(50, "ipv4:203.0.113.7")
    budget.release(50, "ipv6:[2001:db8::1]")
    assert budget.used == 0 and budget.by_caller == {}


def test_a_stream_that_goes_quiet_ends_at_its_idle_timeout_and_gives_its_bytes_back():
    limits = Limits(max_tensor_bytes=1 << 20, allowed_names=frozenset({"inputs"}))
    x = encode_tensor("inputs", torch.randn(100, 100), get_codec("none"))
    first = list(iter_frames(META, [x], chunk_bytes=1000))[:3]
    budget = ByteBudget(limit=4 << 20)

    async def stalls():
        for frame in first:
            yield frame
        await asyncio.sleep(60)

    async def read() -> None:
        await read_call(stalls(), limits, budget, "ipv4:203.0.113.7", idle_timeout=0.2)

    with pytest.raises(TimeoutError):
        asyncio.run(asyncio.wait_for(read(), 5))
    assert budget.used == 0 and budget.arrived == 3000


def test_a_stream_being_read_holds_budget_for_its_next_frame():
    """gRPC receives a stream's next message into memory once it is asked for: the budget counts that frame before it
    is read, so that a flood of streams is refused instead of being read all at once."""
    limits = Limits(max_tensor_bytes=1 << 20, allowed_names=frozenset({"inputs"}))
    x = encode_tensor("inputs", torch.randn(100, 100), get_codec("none"))
    budget = ByteBudget(limit=limits.frame_bytes + 5000)
    held_while_asked: list[int] = []

    async def watched():
        for frame in iter_frames(META, [x], chunk_bytes=1000):
            held_while_asked.append(budget.used)
            yield frame

    with pytest.raises(Busy):
        asyncio.run(read_call(watched(), limits, budget))
    # 6 chunks of 1000 bytes, each asked for with a frame's room held; no room for the 7th: it was never asked for
    assert held_while_asked == [limits.frame_bytes + 1000 * i for i in range(6)]
    assert budget.used == 0


def test_refused_streams_are_drained_so_many_at_once_and_the_rest_wait_their_turn_or_end_unread():
    drains, read, reading, most = Drains(at_once=2, waiting=3), [], set(), [0]

    async def stream(i: int, chunks: int):
        for _ in range(chunks):
            reading.add(i)
            most[0] = max(most[0], len(reading))
            read.append(i)
            yield b"x" * 10
            await asyncio.sleep(0.01)
        reading.discard(i)

    async def flood() -> float:
        started = asyncio.get_running_loop().time()
        # 2 read at once, 3 wait for a slot, the 6th and 7th find no room and are ended unread
        await asyncio.gather(*(drains.drain(stream(i, 5), max_bytes=10**9, seconds=5) for i in range(7)))
        return asyncio.get_running_loop().time() - started

    assert asyncio.run(flood()) < 2
    assert most[0] == 2 and sorted(set(read)) == [0, 1, 2, 3, 4] and all(read.count(i) == 5 for i in range(5))
    assert drains.running == drains.waiting == 0


def test_a_drain_stops_at_its_bytes_and_a_waiting_stream_at_its_seconds():
    drains, read = Drains(at_once=1), []

    async def endless(i: int):
        while True:
            read.append(i)
            yield b"x" * 10
            await asyncio.sleep(0.01)

    async def run() -> float:
        loop = asyncio.get_running_loop()
        hog = asyncio.ensure_future(drains.drain(endless(0), max_bytes=10**9, seconds=0.5))
        await asyncio.sleep(0.05)
        await drains.drain(endless(1), max_bytes=10**9, seconds=0.1)  # no slot within 0.1 s: never read
        await hog
        started = loop.time()
        await drains.drain(endless(9), max_bytes=25, seconds=5)  # stops after 30 bytes, not after 5 s
        return loop.time() - started

    assert asyncio.run(run()) < 1
    assert 1 not in read and read.count(9) == 3 and drains.running == drains.waiting == 0


def test_call_meta_strings_and_signatures_are_bounded():
    limits = Limits(max_tensor_bytes=1 << 20, allowed_names=frozenset({"inputs"}))
    for field, value in [
        ("microbatch_id", "m" * 129),
        ("reply_codec_name", "piecewise4" * 20),
        ("admitted_by", "k" * 200),
        ("admission_signature", b"\x00" * 1025),
    ]:
        meta = pb.CallMeta(protocol_version=PROTOCOL_VERSION, **{field: value})
        with pytest.raises(WireError, match=field):
            asyncio.run(read_call(_stream([encode_frame(meta)]), limits))
