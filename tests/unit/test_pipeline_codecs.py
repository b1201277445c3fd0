"""The pipeline's compressing codecs: piecewise N-bit, low-rank activation gradients and token top-k with lazy error
propagation; garbage and forged parameters; the reply codec a caller asks for and when a server uses it, alone and through a real
stage server."""

import asyncio
import math

import grpc
import pytest
import torch

from swarm.compression import CodecContext, CompressionPolicy, TensorRole, get_codec
from swarm.compression.memory import ErrorMemory
from swarm.compression.piecewise import magnitude_levels
from swarm.compression.policy import epilogue_codec, requested_reply_codec
from swarm.config import tiny_test
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.tensors import EncodedTensor, WireError, WireStats, check_encoded, decode_tensor, encode_tensor
from tests.stages import InProcessStages
from trainer.client import StageClient

CPU = torch.device("cpu")
GRADIENT_CODECS = ["lowrank4", "lowrank4-noef", "topk50+piecewise4", "topk25+none-noef"]


def ctx(memory: ErrorMemory | None, batch: int = 0) -> CodecContext:
    return CodecContext(TensorRole.ACTIVATION_GRADIENTS, "grad_inputs", memory, batch)


def sent(name: str, x: torch.Tensor, memory: ErrorMemory | None, batch: int = 0) -> torch.Tensor:
    return decode_tensor(encode_tensor("grad_inputs", x, get_codec(name), ctx(memory, batch)), CPU)


def linear_quantize(x: torch.Tensor, bits: int, blocksize: int = 256) -> torch.Tensor:
    """Symmetric linear N-bit with a per-block absmax scale (AccTFM's eq. 4-5): the baseline piecewise must beat."""
    n = x.numel()
    v = torch.zeros(-(-n // blocksize) * blocksize)
    v[:n] = x.reshape(-1)
    v = v.view(-1, blocksize)
    step = v.abs().amax(1, keepdim=True) / (2 ** (bits - 1) - 1)
    return ((v / step).round() * step).view(-1)[:n].view_as(x)


@pytest.mark.parametrize("bits", range(2, 9))
def test_piecewise_levels_double_away_from_zero(bits):
    levels = magnitude_levels(bits)
    assert len(levels) == 2 ** (bits - 1) and levels[0] == 0 and levels[-1] == 1
    steps = [b - a for a, b in zip(levels, levels[1:], strict=False)]
    ratios = [round(s2 / s1, 9) for s1, s2 in zip(steps, steps[1:], strict=False)]
    assert set(ratios) <= {1.0, 2.0} and ratios.count(2.0) == bits - 2, steps
    assert min(steps) == pytest.approx(1 / ((bits - 1) * 2 ** (bits - 2)))  # U_0 = max / (m 2^(m-1))


@pytest.mark.parametrize("bits", range(2, 9))
def test_piecewise_error_within_half_a_step_of_its_block(bits):
    x = torch.distributions.StudentT(3).sample((5000,)) * 1e-3
    codec = get_codec(f"piecewise{bits}")
    y = decode_tensor(encode_tensor("inputs", x, codec), CPU)
    levels = torch.tensor(magnitude_levels(bits))
    widest = float((levels[1:] - levels[:-1]).max())
    scale = torch.zeros(20 * 256)
    scale[: x.numel()] = x.abs()
    scale = scale.view(20, 256).amax(1).repeat_interleave(256)[: x.numel()]
    assert bool(((y - x).abs() <= scale * widest / 2 * (1 + 1e-5) + 1e-12).all())
    assert bool((torch.sign(y) * torch.sign(x) >= 0).all())


@pytest.mark.parametrize("bits", range(3, 9))
def test_piecewise_beats_linear_on_heavy_tailed_data(bits):
    """Activations and their gradients are heavy-tailed; at 2 bits the two schemes have the same levels."""
    x = torch.distributions.StudentT(3).sample((64, 512))
    y = decode_tensor(encode_tensor("inputs", x, get_codec(f"piecewise{bits}")), CPU)
    assert (y - x).pow(2).mean() < (linear_quantize(x, bits) - x).pow(2).mean()


def test_piecewise_on_every_shape_and_extreme():
    codec = get_codec("piecewise4")
    for x in (torch.zeros(7), torch.full((3, 300), -65504.0), torch.tensor([1e-38, -1e-38]), torch.randn(1)):
        enc = encode_tensor("inputs", x, codec)
        assert len(enc.payload) == codec.encoded_bytes(x.numel(), x.dtype)
        y = decode_tensor(enc, CPU)
        assert torch.isfinite(y).all() and y.abs().max() <= x.abs().max()
    with pytest.raises(ValueError, match="non-finite"):
        encode_tensor("inputs", torch.tensor([1.0, math.inf]), codec)


@pytest.mark.parametrize("rank", [1, 3, 8])
def test_lowrank_reconstructs_a_low_rank_gradient(rank):
    gen = torch.Generator().manual_seed(rank)
    g = (torch.randn(4 * 32, rank, generator=gen) @ torch.randn(rank, 48, generator=gen)).view(4, 32, 48)
    y = sent(f"lowrank{rank}", g, ErrorMemory())
    assert ((y - g).norm() / g.norm()) < 2e-3  # P travels fp16: its rounding, nothing else
    enc = encode_tensor("grad_inputs", g, get_codec(f"lowrank{rank}"))
    assert len(enc.payload) == (128 * 2 + 48 * 4) * rank


@pytest.mark.parametrize("name", GRADIENT_CODECS)
def test_error_feedback_sends_the_batch_sum_and_never_crosses_a_batch(name):
    """Within a global batch, what was sent plus the error still held is exactly what was computed; the error of
    one batch never reaches the next."""
    gen = torch.Generator().manual_seed(0)
    memory = ErrorMemory()
    true = [torch.randn(2, 16, 32, generator=gen) for _ in range(6)]
    total = sum(sent(name, g, memory, batch=7) for g in true)
    carried = memory.carried
    held = memory.take_error(("activation_gradients", "grad_inputs", (2, 16, 32)), 7)
    exact = sum(true)
    if name.endswith("-noef"):
        assert held is None and carried == 0
        return
    assert held is not None and carried == 5
    assert torch.allclose(total + held.view_as(exact), exact, atol=1e-4)
    # the residual stays bounded (it is what this microbatch's compression missed, not a sum over microbatches)
    assert held.norm() < 1.5 * exact.norm()
    sent(name, true[0], memory, batch=7)
    fresh = ErrorMemory()  # the same warm start (low-rank), no error
    for stream, query in memory._warm.items():
        fresh.put_warm_start(stream, query)
    assert torch.equal(sent(name, true[1], memory, batch=8), sent(name, true[1], fresh, batch=8))
    assert memory.dropped == 1


def test_error_memory_is_bounded():
    memory = ErrorMemory(max_streams=3)
    for rows in range(1, 10):
        sent("lowrank2", torch.randn(rows, 4, 8), memory)
    assert len(memory._errors) == 3 and len(memory._warm) == 3
    assert memory.held_bytes() == sum(r * 4 * 8 * 4 + 8 * 2 * 4 for r in (7, 8, 9))


def test_token_topk_keeps_the_largest_rows():
    g = torch.randn(3, 10, 16)
    g[1, 4] *= 100
    y = sent("topk20+none-noef", g, None)
    kept = (y.abs().sum(-1) > 0).view(-1)
    assert int(kept.sum()) == 6  # ceil(0.2 * 30)
    norms = g.norm(dim=-1).view(-1)
    assert norms[kept].min() >= norms[~kept].max()
    assert torch.equal(y.view(30, 16)[kept], g.view(30, 16)[kept])
    enc = encode_tensor("grad_inputs", g, get_codec("topk20+piecewise4"))
    assert len(enc.payload) == 4 + get_codec("piecewise4").encoded_bytes(6 * 16, torch.float32)


def forged(enc: EncodedTensor, params: bytes | None = None, payload: bytes | None = None) -> EncodedTensor:
    header = pb.TensorHeader()
    header.CopyFrom(enc.header)
    if params is not None:
        header.codec_params = params
    return EncodedTensor(header, enc.payload if payload is None else payload)


def test_garbage_and_forged_parameters_are_refused():
    x = torch.randn(4, 8, 16)
    pw = encode_tensor("grad_inputs", x, get_codec("piecewise4"))
    lr = encode_tensor("grad_inputs", x, get_codec("lowrank4"))
    tk = encode_tensor("grad_inputs", x, get_codec("topk50+piecewise4"))
    p = bytes(tk.header.codec_params)
    nan16 = torch.tensor([math.nan], dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    cases = [
        forged(pw, params=b"\x09\x00\x01\x00\x00"),  # 9 bits
        forged(pw, params=b"\x04\x00\x00\x00\x00"),  # block size 0
        forged(pw, payload=bytes(pw.payload)[:-1]),
        forged(pw, payload=bytes(pw.payload)[:-4] + b"\x00\x00\xc0\x7f"),  # a NaN scale
        forged(pw, payload=bytes(pw.payload)[:-4] + b"\x00\x00\x80\xbf"),  # a negative scale
        forged(lr, params=(0).to_bytes(4, "little")),
        forged(lr, params=(17).to_bytes(4, "little")),  # above min(M, d)
        forged(lr, params=(2**31).to_bytes(4, "little")),
        forged(lr, payload=bytes(lr.payload) + b"\x00"),
        forged(lr, payload=nan16 + bytes(lr.payload)[2:]),
        forged(tk, params=(0).to_bytes(4, "little") + p[4:]),  # no rows
        forged(tk, params=(33).to_bytes(4, "little") + p[4:]),  # more rows than the tensor has
        forged(tk, params=p[:4] + bytes([pb.CODEC_LOWRANK]) + p[5:]),  # a stateful codec inside
        forged(tk, params=p[:4] + bytes([99]) + p[5:]),
        forged(tk, params=p[:3]),
        forged(tk, params=(15).to_bytes(4, "little") + p[4:]),  # the mask selects 16
        forged(tk, payload=b"\xff" * 4 + bytes(tk.payload)[4:]),  # 32 rows selected, 16 declared
        forged(tk, payload=bytes(tk.payload)[:3]),
    ]
    for i, enc in enumerate(cases):
        with pytest.raises(WireError):
            decode_tensor(enc, CPU)
            pytest.fail(f"case {i} decoded")
        with pytest.raises(WireError):
            check_encoded(enc, "grad_outputs", 65504.0)
            pytest.fail(f"case {i} passed the value check")


def test_extreme_decoded_values_are_refused():
    """A low-rank payload bounds nothing: the receiver decodes it and checks every value."""
    huge = encode_tensor("grad_inputs", torch.full((4, 8), 1e30), get_codec("lowrank1"))
    with pytest.raises(WireError, match="outside"):
        check_encoded(huge, "grad_outputs", 65504.0)
    bounded = encode_tensor("grad_inputs", torch.full((4, 8), 1e6), get_codec("topk50+piecewise4"))
    with pytest.raises(WireError, match="block scale"):
        check_encoded(bounded, "grad_outputs", 65504.0)


def test_codec_names_and_roles():
    for bad in (
        "lowrank0",
        "lowrank999",
        "topk0+none",
        "topk100+none",
        "topk50+lowrank4",
        "topk50+topk50+none",
        "piecewise1",
        "piecewise9",
        "x" * 10_000,
    ):
        with pytest.raises(ValueError, match="codec"):
            get_codec(bad)
    with pytest.raises(ValueError, match="activation gradients only"):
        CompressionPolicy(activations="lowrank8")
    with pytest.raises(ValueError, match="allreduce_gradients"):
        CompressionPolicy(allreduce_gradients="piecewise4")
    assert CompressionPolicy.for_wire("piecewise4", "topk50+piecewise4-noef").activation_gradients == (
        "topk50+piecewise4-noef"
    )


def test_a_requested_reply_codec_is_checked_as_a_policys_codecs_are():
    """A reply codec by wire value is one without settings; by name, a gradients-only one is for Backward replies
    only, and its epilogue a share in [0, 1]. The service refuses the rest with INVALID_ARGUMENT and these words."""
    assert requested_reply_codec(pb.CallMeta(reply_codec=pb.CODEC_FLOAT16), backward=False).name == "fp16"
    named = pb.CallMeta(reply_codec_name="lowrank4", reply_epilogue=0.25)
    assert requested_reply_codec(named, backward=True).name == "lowrank4"
    for meta, backward, message in (
        (pb.CallMeta(reply_codec_name="lowrank4"), False, "^reply codec 'lowrank4' is for Backward replies only$"),
        (pb.CallMeta(reply_codec_name="lowrank0"), True, "^reply codec: "),
        (pb.CallMeta(reply_codec_name="x" * 100), True, "^reply codec: unknown codec"),
        (pb.CallMeta(reply_codec_name="topk50+none", reply_epilogue=1.5), True, "^reply_epilogue 1.5 outside"),
        (pb.CallMeta(reply_codec_name="topk50+none", reply_epilogue=math.nan), True, "^reply_epilogue nan outside"),
        (pb.CallMeta(reply_codec=pb.CODEC_LOWRANK), True, "must be named"),
        (pb.CallMeta(reply_codec=99), True, "^unknown reply codec 99$"),
    ):
        with pytest.raises(ValueError, match=message):
            requested_reply_codec(meta, backward)


def test_a_gradients_only_reply_codec_is_used_in_the_epilogue_of_the_batch_only():
    """`epilogue_codec` with an epilogue of 0.25: a low-rank reply once the stage holds more than 0.75 of its global
    batch (this microbatch included), 8-bit before; with an epilogue of 0 or 1, or a codec that carries no error, the
    codec asked for, without reading the batch's share."""
    lowrank = get_codec("lowrank4")
    chosen = [epilogue_codec(lowrank, 0.25, lambda done=done: done).name for done in (0.25, 0.5, 0.75, 1.0)]
    assert chosen == ["blockwise8"] * 3 + ["lowrank4"]

    def unread() -> float:
        raise AssertionError("the batch's share is read only where the rule needs it")

    for codec, epilogue in ((lowrank, 0.0), (lowrank, 1.0), (get_codec("piecewise4"), 0.25)):
        assert epilogue_codec(codec, epilogue, unread) is codec


def test_epilogue_only_compression_compresses_the_microbatches_that_complete_the_batch():
    """`reply_epilogue` 0.25 with a global batch of 16 in microbatches of 4: the first three Backwards of each batch
    reply 8-bit, the fourth low-rank; an epilogue outside [0, 1] is refused."""
    cfg = tiny_test()

    async def main():
        async with InProcessStages(cfg, samples_per_step=16, stages=[1]) as stages:
            client = StageClient(CompressionPolicy.for_wire("none", "lowrank4"), WireStats(), 1 << 26, 65504.0, 0.25)
            h = torch.randn(4, cfg.max_seq_len, cfg.d_model)
            codecs = []
            try:
                for _ in range(8):
                    reply = await client.call(
                        stages.addresses[1], "Backward", 1, "m", {"inputs": h, "grad_outputs": h}, h.shape, 60
                    )
                    assert reply.encoded is not None
                    codecs.append(reply.encoded.header.codec)
                assert stages.workers[1].param_version == 2
                client.backward_epilogue = -0.5  # a forged value: the trainer itself refuses it at start
                with pytest.raises(grpc.aio.AioRpcError, match="reply_epilogue"):
                    await client.call(
                        stages.addresses[1], "Backward", 1, "m", {"inputs": h, "grad_outputs": h}, h.shape, 60
                    )
            finally:
                await client.close()
            assert codecs == [pb.CODEC_BLOCKWISE8] * 3 + [pb.CODEC_LOWRANK] + [pb.CODEC_BLOCKWISE8] * 3 + [
                pb.CODEC_LOWRANK
            ]

    asyncio.run(main())
