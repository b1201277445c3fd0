"""Codec round trips with written-down error bounds, and the wire stream format."""

import asyncio
import math

import pytest
import torch
from hivemind.proto import runtime_pb2

from swarm.compression import CODECS, Blockwise8Codec, get_codec
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.frames import (
    FRAME_SLACK_BYTES,
    VIEW_MIN_BYTES,
    Limits,
    _varint,
    encode_frame,
    iter_frames,
    keep_payload,
    read_call,
)
from swarm.protocol.rpc import CHUNK_BYTES, PROTOCOL_VERSION
from swarm.protocol.tensors import (
    EncodedTensor,
    WireError,
    WireStats,
    check_encoded,
    decode_tensor,
    encode_tensor,
    fingerprint,
    relayed,
)

CPU = torch.device("cpu")
# Bounds are relative to the tensor's RMS, for Gaussian data. fp16 has an 11-bit mantissa (2^-11 relative per value);
# dynamic 8-bit blockwise quantisation keeps ~1e-2 relative RMS error (Dettmers et al., 8-bit optimizers).
RMS_BOUNDS = {"none": 0.0, "fp16": 1e-3, "blockwise8": 2e-2}
# piecewise N-bit, Gaussian data in blocks of 256, measured (0.81, 0.25, 0.11, 0.059, 0.035, 0.023, 0.016) plus ~5%:
# its largest step is a third of the block's scale at 4 bits, so these are far above 8-bit's
RMS_BOUNDS |= {
    f"piecewise{b}": bound
    for b, bound in zip(range(2, 9), (0.85, 0.27, 0.12, 0.063, 0.038, 0.025, 0.018), strict=False)
}


def rel_rms(a, b):
    return ((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt()).item()


async def _frames(frames):
    for f in frames:
        yield f


def roundtrip(tensors, chunk_bytes=1 << 20, names=("inputs", "labels")):
    meta = pb.CallMeta(protocol_version=PROTOCOL_VERSION, microbatch_id="m")
    frames = list(iter_frames(meta, tensors, chunk_bytes))
    limits = Limits(max_tensor_bytes=64 << 20, allowed_names=frozenset(names))
    return frames, asyncio.run(read_call(_frames(frames), limits))


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codec_roundtrip_error_bound(name, dtype):
    x = torch.randn(3, 1000, 7, generator=torch.Generator().manual_seed(0)).to(dtype)
    enc = encode_tensor("inputs", x, get_codec(name))
    y = decode_tensor(enc, torch.device("cpu"))
    assert y.dtype == x.dtype and y.shape == x.shape
    assert rel_rms(y, x) <= RMS_BOUNDS[name] + (4e-3 if dtype == torch.bfloat16 and name != "none" else 0)


def test_blockwise8_stored_map_and_cpu_decoder_are_bitsandbytes_own():
    """The map stored in blockwise.py is bitsandbytes' `create_dynamic_map()`, and the torch CPU decoder gives
    bitwise what bitsandbytes' CPU decoder gives, for every code, ragged last blocks and extreme scales."""
    import bitsandbytes.functional as bnbf

    from swarm.compression.blockwise import decode_cpu, dynamic_map

    assert torch.equal(dynamic_map(torch.device("cpu")), bnbf.create_dynamic_map())
    generator = torch.Generator().manual_seed(0)
    for n, blocksize in ((1, 4096), (256, 64), (4096, 4096), (3 * 4096 + 5, 4096), (100_003, 256)):
        codes = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator)
        absmax = (
            torch.rand(-(-n // blocksize), generator=generator)
            * torch.logspace(-30, 30, 7).repeat(n)[: -(-n // blocksize)]
        )
        theirs = bnbf.dequantize_blockwise(codes, absmax=absmax, code=bnbf.create_dynamic_map(), blocksize=blocksize)
        assert torch.equal(decode_cpu(codes, absmax, blocksize), theirs), (n, blocksize)


def test_hivemind_8bit_parts_are_read_and_written_alike_by_torch_and_bitsandbytes():
    """The all-reduce's 8-bit format, now encoded and decoded by torch on the CPU: hivemind's own (bitsandbytes)
    reader reads ours bitwise alike, ours reads its; sizes are checked before anything is decoded."""
    from hivemind.compression import BlockwiseQuantization, CompressionInfo

    from server.collab.compat.codec import TorchBlockwiseQuantization

    ours, theirs = TorchBlockwiseQuantization(), BlockwiseQuantization()
    for shape in ((1,), (4096,), (3, 5000), (7, 1, 4097)):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
        x.view(-1)[::97] *= 30
        info = CompressionInfo.from_tensor(x)
        mine, reference = ours.compress(x, info), theirs.compress(x, info)
        assert len(mine.buffer) == len(reference.buffer) and mine.buffer[:16] == reference.buffer[:16]
        assert torch.equal(ours.extract(mine), theirs.extract(mine))
        assert torch.equal(ours.extract(reference), theirs.extract(reference))
        assert (ours.extract(mine) - x).abs().max() <= x.abs().max() / 60
    x = torch.randn(5000)
    good = ours.compress(x, CompressionInfo.from_tensor(x))
    header = good.buffer[:16]
    for buffer in (
        good.buffer[:10],  # truncated header
        good.buffer[:-1],  # one code short
        (3).to_bytes(8, "little") + header[8:] + good.buffer[16:],  # a scale count the shape does not give
        header[:8] + (100_000).to_bytes(8, "little") + good.buffer[16:],  # a map of 100,000 entries
        header[:8]
        + (2).to_bytes(8, "little")
        + good.buffer[16:32]  # the 2 scales, then the first 2 entries of the map
        + good.buffer[16 + 8 + 1024 :],  # codes past a map of 2
    ):
        bad = runtime_pb2.Tensor()
        bad.CopyFrom(good)
        bad.buffer = buffer
        with pytest.raises(ValueError, match="8-bit blockwise tensor (of|with codes beyond)"):
            ours.extract(bad)


def test_blockwise8_cpu_encoder_zero_and_non_finite_blocks():
    """A block of zeros decodes to zeros (its scale is 0, not a division by it); a tensor with NaN or inf goes to
    bitsandbytes' encoder, as before the torch one existed (the decoder refuses an infinite scale; senders check their
    values before they encode: service.py, check_values)."""
    codec = get_codec("blockwise8")
    x = torch.cat([torch.zeros(5000), torch.randn(3000)])
    y = decode_tensor(encode_tensor("inputs", x, codec), torch.device("cpu"))
    assert (y[:4096] == 0).all() and rel_rms(y, x) <= RMS_BOUNDS["blockwise8"]
    for bad in (float("nan"), float("inf")):
        x[7000] = bad
        _, payload = codec.encode(x)
        _, reference = Blockwise8Codec(cpu_encoder="bitsandbytes").encode(x)
        assert bytes(payload) == bytes(reference)
    with pytest.raises(WireError, match="non-finite block scale"):
        decode_tensor(encode_tensor("inputs", x, codec), torch.device("cpu"))


def test_blockwise8_is_four_times_smaller():
    x = torch.randn(4, 512, 1024)
    enc = encode_tensor("inputs", x, get_codec("blockwise8"))
    assert x.numel() * 4 / enc.wire_bytes >= 3.9


@pytest.mark.parametrize("name", sorted(CODECS))
def test_codec_parameters_are_checked_before_the_payload(name):
    """Codec parameters travel opaque in the header; each codec refuses ones it did not write."""
    enc = encode_tensor("inputs", torch.randn(64, 64), get_codec(name))
    bad = [b"\x00" * 17, b"\xff" * 4, b"\x00\x01\x00\x00" if name == "blockwise8" else b"x"]  # 17 bytes; 2**32-1; 256
    for params in bad:
        header = pb.TensorHeader()
        header.CopyFrom(enc.header)
        header.codec_params = params
        with pytest.raises(WireError):
            decode_tensor(EncodedTensor(header, enc.payload), torch.device("cpu"))


@pytest.mark.parametrize("name", sorted(CODECS))
def test_encoded_bytes_predicts_the_payload(name):
    for numel in (1, 4095, 4096, 4097, 100_000):
        x = torch.randn(numel)
        assert len(get_codec(name).encode(x)[1]) == get_codec(name).encoded_bytes(numel, x.dtype)


def test_integer_tensors_travel_exactly():
    ids = torch.randint(0, 256, (4, 9))
    enc = encode_tensor("labels", ids, get_codec("blockwise8"))
    assert enc.header.codec == pb.CODEC_NONE
    assert torch.equal(decode_tensor(enc, torch.device("cpu")), ids)


def test_stream_chunks_and_reassembles():
    x = torch.randn(1000, 300)
    ids = torch.randint(0, 256, (5, 5))
    encs = [encode_tensor("inputs", x, get_codec("none")), encode_tensor("labels", ids, get_codec("none"))]
    frames, call = roundtrip(encs, chunk_bytes=100_000)
    assert len(frames) > 10
    assert torch.equal(decode_tensor(call.tensors["inputs"], torch.device("cpu")), x)
    assert torch.equal(decode_tensor(call.tensors["labels"], torch.device("cpu")), ids)


def test_a_received_payload_is_held_in_its_frames_and_joined_where_it_is_decoded():
    x = torch.randn(4, 512, 64, generator=torch.Generator().manual_seed(0))  # 512 KiB
    frames, call = roundtrip([encode_tensor("inputs", x, get_codec("none"))], chunk_bytes=128 << 10)
    enc = call.tensors["inputs"]
    assert len(frames) == 4 and enc.joined is False  # the event loop copied nothing
    assert enc.nbytes == enc.header.payload_bytes == x.numel() * 4 and enc.wire_bytes > enc.nbytes
    assert enc.joined is False  # counting bytes does not join
    assert torch.equal(decode_tensor(enc, torch.device("cpu")), x)
    assert enc.joined is True


def test_a_received_tensor_is_sent_on_in_the_frames_it_came_in():
    """A trainer sends a reply on to the next stage: the frames of its payload after the first go out as the same
    objects (no copy); only the first piece, which shared its frame with the header, is framed again."""
    x = torch.randn(4, 512, 64, generator=torch.Generator().manual_seed(0))  # 512 KiB: 4 frames of 128 KiB
    frames, call = roundtrip([encode_tensor("outputs", x, get_codec("none"))], 128 << 10, names=("outputs",))
    sent_on = relayed(call.tensors["outputs"], "inputs")
    assert sent_on.bytes_to_frame == 128 << 10  # the first piece
    again = list(iter_frames(pb.CallMeta(protocol_version=PROTOCOL_VERSION), [sent_on], 128 << 10))
    assert len(again) == 4 and all(a is b for a, b in zip(again[1:], frames[1:], strict=True))
    limits = Limits(max_tensor_bytes=64 << 20, allowed_names=frozenset({"inputs"}))
    got = asyncio.run(read_call(_frames(again), limits)).tensors["inputs"]
    assert got.relay_frames() is not None  # and on again from there
    assert torch.equal(decode_tensor(got, CPU), x)

    decode_tensor(sent_on, CPU)  # joined: its frames go with its pieces (no second copy held)
    assert sent_on.relay_frames() is None and sent_on.bytes_to_frame == sent_on.nbytes
    assert torch.equal(decode_tensor(relayed(sent_on, "x"), CPU), x)


def test_only_frames_of_nothing_but_their_piece_are_sent_on_as_they_came():
    """A frame with anything beside its data (an unknown field, a second data field), or with more than a chunk of it
    (a libp2p message may carry more than a gRPC one), is not resent: what goes on is framed again from the checked
    bytes, in chunks, and reads back the same."""
    x = torch.randn(3 * VIEW_MIN_BYTES // 4, generator=torch.Generator().manual_seed(2))
    enc = encode_tensor("outputs", x, get_codec("none"))
    meta = pb.CallMeta(protocol_version=PROTOCOL_VERSION)
    payload, third = bytes(enc.payload), enc.nbytes // 3
    extra = bytes([15 << 3 | 0]) + _varint(7)  # field 15, a varint: protobuf keeps it as unknown
    middle = payload[third : 2 * third]
    limits = Limits(max_tensor_bytes=64 << 20, allowed_names=frozenset({"outputs"}))
    cases = {
        "clean": (encode_frame(data=middle), True),
        "an unknown field after": (encode_frame(data=middle) + extra, False),
        "an unknown field before": (extra + encode_frame(data=middle), False),
        "a data field before": (encode_frame(data=bytes(8)) + encode_frame(data=middle), False),  # the last counts
    }
    for case, (frame, kept) in cases.items():
        frames = [encode_frame(meta, enc.header, payload[:third]), frame, encode_frame(data=payload[2 * third :])]
        got = asyncio.run(read_call(_frames(frames), limits)).tensors["outputs"]
        assert (got.relay_frames() is not None) is kept, case
        again = list(iter_frames(meta, [relayed(got, "outputs")]))
        assert any(f is frame for f in again) is kept, case
        assert kept or again == list(iter_frames(meta, [enc])), case  # framed afresh: nothing of the odd frame
        assert torch.equal(decode_tensor(asyncio.run(read_call(_frames(again), limits)).tensors["outputs"], CPU), x)

    big = torch.randn(3 * CHUNK_BYTES // 4, generator=torch.Generator().manual_seed(3))  # 3 chunks
    enc = encode_tensor("outputs", big, get_codec("none"))
    payload = bytes(enc.payload)
    oversized = [encode_frame(meta, enc.header, payload[:CHUNK_BYTES]), encode_frame(data=payload[CHUNK_BYTES:])]
    got = asyncio.run(read_call(_frames(oversized), limits)).tensors["outputs"]
    assert got.relay_frames() is None
    again = list(iter_frames(meta, [relayed(got, "outputs")]))
    assert len(again) == 3 and all(len(f) <= CHUNK_BYTES + 64 for f in again)


def test_a_reply_of_plain_values_is_checked_in_its_pieces():
    """codec none (float32, bfloat16) and fp16: every piece is read where it lies (nothing joined); NaN, inf or a
    value beyond the bound in any piece is refused, also with a bound fp16 cannot hold (1e5: inf in fp16, where a
    comparison in the payload's dtype let inf through). Pieces split inside a value, and fp16 for a bfloat16 tensor
    (whose values round on decoding), are joined and checked as decoded."""
    gen = torch.Generator().manual_seed(1)
    for codec, dtype, bound in [
        ("none", torch.float32, 100.0),
        ("none", torch.bfloat16, 100.0),
        ("fp16", torch.float32, 100.0),
        ("fp16", torch.float32, 1e5),
    ]:
        x = torch.randn(4, 256, 128, generator=gen).to(dtype)  # 4 or 2 frames of 128 KiB: held as they came
        _, call = roundtrip([encode_tensor("outputs", x, get_codec(codec))], 128 << 10, names=("outputs",))
        enc = call.tensors["outputs"]
        assert len(enc.pieces) > 1 and check_encoded(enc, "reply", bound) is None and not enc.joined, (codec, dtype)
        for where in [(0, 0, 0), (1, 255, 0), (3, 255, 127)]:  # in the first, a middle and the last piece
            for bad in (math.nan, math.inf, -math.inf, -2 * bound):
                y = x.clone()
                y[where] = bad
                _, call = roundtrip([encode_tensor("outputs", y, get_codec(codec))], 128 << 10, names=("outputs",))
                enc = call.tensors["outputs"]
                with pytest.raises(WireError, match="outside"):
                    check_encoded(enc, "reply", bound)
                assert not enc.joined, (codec, dtype, bound, where, bad)  # refused in its pieces

    y = torch.randn(1000, generator=gen)
    y[500] = math.nan
    enc = encode_tensor("outputs", y, get_codec("none"))
    split = EncodedTensor(enc.header, [bytearray(bytes(enc.payload)[:1999]), bytearray(bytes(enc.payload)[1999:])])
    with pytest.raises(WireError, match="outside"):
        check_encoded(split, "reply", 100.0)
    assert split.joined
    short = EncodedTensor(enc.header, [bytearray(bytes(enc.payload)[:400])])  # its header says 4000 bytes
    with pytest.raises(WireError, match="payload is 400 bytes"):
        check_encoded(short, "reply", 100.0)

    # 65504 in fp16 (within the bound) under a bfloat16 header: it decodes to 65536, beyond the bound
    enc = encode_tensor("outputs", torch.full((1000,), 65504.0), get_codec("fp16"))
    header = pb.TensorHeader()
    header.CopyFrom(enc.header)
    header.dtype = pb.DTYPE_BFLOAT16
    pieces = EncodedTensor(header, [bytearray(bytes(enc.payload)[:1000]), bytearray(bytes(enc.payload)[1000:])])
    with pytest.raises(WireError, match="outside"):
        check_encoded(pieces, "reply", 65504.0)
    assert pieces.joined


def test_a_small_payload_or_one_beside_other_fields_is_copied_not_held():
    """The budget counts payload bytes: holding every tiny frame as an object, or a large frame for a little payload,
    would hold far more memory than it counts."""
    pieces: list = []
    big = bytes(VIEW_MIN_BYTES)
    keep_payload(pieces, memoryview(big), len(big) + 20)  # most of its frame: held as it came
    assert len(pieces) == 1 and isinstance(pieces[0], memoryview) and pieces[0].obj is big
    keep_payload(pieces, memoryview(b"ab"), 22)  # tiny: copied
    keep_payload(pieces, memoryview(b"cd"), 22)  # onto the same copy
    padded = bytes(FRAME_SLACK_BYTES + 2 * VIEW_MIN_BYTES)
    keep_payload(pieces, memoryview(padded)[:VIEW_MIN_BYTES], len(padded))  # half of its frame is something else
    assert len(pieces) == 2 and bytes(pieces[1]) == b"abcd" + bytes(VIEW_MIN_BYTES)

    # a whole tensor in 1000-byte frames arrives as one copy, not thousands of held frames
    x = torch.randn(64, 100, generator=torch.Generator().manual_seed(1))
    frames, call = roundtrip([encode_tensor("inputs", x, get_codec("none"))], chunk_bytes=1000)
    assert len(frames) == 26 and len(call.tensors["inputs"]._pieces) == 1
    assert torch.equal(decode_tensor(call.tensors["inputs"], torch.device("cpu")), x)


def test_frames_padded_with_other_fields_are_copied_not_held():
    """A frame whose payload is large but beside a larger field (unknown to us: protobuf keeps it) would hold all of it
    for the payload bytes the budget counts."""
    x = torch.randn(2 * VIEW_MIN_BYTES // 4)
    enc = encode_tensor("inputs", x, get_codec("none"))
    meta = pb.CallMeta(protocol_version=PROTOCOL_VERSION, microbatch_id="m")
    padding = bytes([15 << 3 | 2]) + _varint(1 << 20) + bytes(1 << 20)  # field 15, length-delimited, 1 MiB
    half = enc.nbytes // 2
    frames = [
        encode_frame(meta, enc.header, bytes(enc.payload)[:half]) + padding,
        encode_frame(data=bytes(enc.payload)[half:]),  # payload alone: held as it came
    ]
    limits = Limits(max_tensor_bytes=64 << 20, allowed_names=frozenset({"inputs"}))
    got = asyncio.run(read_call(_frames(frames), limits)).tensors["inputs"]
    assert [type(p) for p in got._pieces] == [bytearray, memoryview]
    assert torch.equal(decode_tensor(got, torch.device("cpu")), x)


def test_a_tensor_decoded_from_its_own_encoding_is_a_copy():
    x = torch.randn(4, 8)
    before = x.clone()
    y = decode_tensor(encode_tensor("inputs", x, get_codec("none")), torch.device("cpu"))
    x += 1  # the payload is a view of x: a decoded tensor sharing it would change too
    assert torch.equal(y, before)


def test_stream_rejects_malformed():
    x = encode_tensor("inputs", torch.randn(10, 10), get_codec("none"))
    payload = bytes(x.payload)
    meta = pb.CallMeta(protocol_version=PROTOCOL_VERSION)
    limits = Limits(max_tensor_bytes=1000, allowed_names=frozenset({"inputs"}))
    cases = {
        "first frame": [pb.Frame(data=b"x")],
        "exceeds": [pb.Frame(meta=meta, tensor=pb.TensorHeader(name="inputs", dtype=1, shape=[1000, 1000]))],
        "unexpected": [pb.Frame(meta=meta, tensor=pb.TensorHeader(name="weights", dtype=1, shape=[1]))],
        "longer": [pb.Frame(meta=meta, tensor=x.header, data=payload + b"xx")],
        "got 10": [pb.Frame(meta=meta, tensor=x.header, data=payload[:10])],
        "protocol": [pb.Frame(meta=pb.CallMeta(protocol_version=99))],
    }
    for match, frames in cases.items():
        with pytest.raises(WireError, match=match):
            asyncio.run(read_call(_frames(frames), limits))


def test_wire_stats_count_fp32_equivalent():
    stats = WireStats()
    stats.add("activations", encode_tensor("inputs", torch.randn(64, 1024), get_codec("blockwise8")))
    d = stats.as_dict()
    assert 3.9 < d["fp32_bytes"] / d["wire_bytes"] < 4.0


@pytest.mark.parametrize("name", sorted(CODECS))
def test_encoded_values_are_checked_with_or_without_decoding(name):
    """check_encoded refuses what check_values refuses on the decoded tensor: 8-bit and piecewise from their block scales alone (a
    forged scale, negative or not, bounds its block), the others by decoding."""
    from swarm.protocol.tensors import check_encoded, decode_checked

    x = torch.randn(3, 5000)
    enc = encode_tensor("outputs", x, get_codec(name))
    decoded = check_encoded(enc, "outputs", bound=100.0)
    assert (decoded is None) == (name == "blockwise8" or name.startswith("piecewise"))  # both bounded by block scales
    assert torch.equal(
        decode_checked(enc, torch.device("cpu"), "outputs", 100.0), decode_tensor(enc, torch.device("cpu"))
    )
    with pytest.raises(WireError, match="outside"):
        check_encoded(enc, "outputs", bound=0.5)
    payload = bytearray(enc.payload)
    if name == "blockwise8" or name.startswith("piecewise"):
        scales = x.numel() if name == "blockwise8" else len(payload) - 4 * -(-x.numel() // 256)
        for forged in (-1e6, 1e6, float("inf"), float("nan")):
            payload[scales + 4 : scales + 8] = torch.tensor([forged]).numpy().tobytes()  # the second block's scale
            with pytest.raises(WireError, match="outside|finite"):
                check_encoded(EncodedTensor(enc.header, payload), "outputs", bound=100.0)
        with pytest.raises(WireError, match="payload is"):
            check_encoded(EncodedTensor(enc.header, payload[:-1]), "outputs", bound=100.0)
    else:
        bad = torch.tensor([float("nan")], dtype=torch.float16 if name == "fp16" else torch.float32)
        payload[: bad.element_size()] = bad.view(torch.uint8).numpy().tobytes()
        with pytest.raises(WireError, match="NaN"):
            check_encoded(EncodedTensor(enc.header, payload), "outputs", bound=100.0)


def test_a_relayed_tensor_is_the_same_bytes_under_a_new_name():
    from swarm.protocol.tensors import relayed

    enc = encode_tensor("outputs", torch.randn(4, 8), get_codec("blockwise8"))
    out = relayed(enc, "inputs")
    assert out.header.name == "inputs" and enc.header.name == "outputs"
    assert out.payload is enc.payload and out.shape == (4, 8)
    assert torch.equal(decode_tensor(out, torch.device("cpu")), decode_tensor(enc, torch.device("cpu")))


def test_a_fingerprint_is_of_the_tensors_not_of_how_they_arrived():
    """The reply cache hands a reply only to the request it was computed for (server/replies.py ReplyCache): the
    fingerprint of one request is the same whatever pieces its payloads came in, and differs for another shape, other
    bytes at either end, another key, or a change anywhere a sender happens to hit."""
    x = torch.randn(4, 64, 32)
    enc = encode_tensor("inputs", x, get_codec("none"))
    raw = bytes(enc.payload)
    pieces = EncodedTensor(enc.header, [memoryview(raw[:1000]), bytearray(raw[1000:5000]), memoryview(raw[5000:])])
    key = b"k" * 16
    assert fingerprint({"inputs": enc}, key) == fingerprint({"inputs": pieces}, key)
    assert fingerprint({"inputs": enc}, key) != fingerprint({"inputs": enc}, b"j" * 16)
    for position in (0, len(raw) - 1):
        changed = bytearray(raw)
        changed[position] ^= 1
        assert fingerprint({"inputs": EncodedTensor(enc.header, changed)}, key) != fingerprint({"inputs": enc}, key)
    reshaped = encode_tensor("inputs", x.reshape(4, 32, 64), get_codec("none"))
    assert fingerprint({"inputs": reshaped}, key) != fingerprint({"inputs": enc}, key)
    other = encode_tensor("inputs", torch.randn(4, 64, 32), get_codec("none"))
    assert fingerprint({"inputs": other}, key) != fingerprint({"inputs": enc}, key)
