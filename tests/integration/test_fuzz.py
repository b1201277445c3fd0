"""Seeded fuzzing of every stage RPC on every stage role (first, middle, last): well-formed calls mutated in their
values, headers, payloads and frame sequence, plus random unary requests. Every call must end in a status a caller
can act on (OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED), never UNKNOWN or INTERNAL; no status
message may exceed the bound; the stages' parameters and gradients stay finite throughout (they step every 8
samples); and afterwards a good microbatch trains through all of them."""

import math
import random
from collections import Counter

import grpc
import pytest
import torch

from server.errors import MAX_STATUS_CHARS
from swarm.compression import CompressionPolicy, get_codec
from swarm.config import tiny_test
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.frames import encode_frame, iter_frames, parse_frame
from swarm.protocol.rpc import PROTOCOL_VERSION, SERVICE, aio_channel
from swarm.protocol.tensors import WireStats, encode_tensor
from tests.stages import InProcessStages, random_batch, run_microbatch
from trainer.client import StageClient

pytestmark = pytest.mark.timeout(300)
CASES = 480
ACCEPTABLE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
SPECIAL_FLOATS = [float("nan"), float("inf"), -float("inf"), 3e38, -3e38, 65505.0, 1e30, 1e-45]
SPECIAL_INTS = [-1, -(2**62), 2**62, 2**31, 10**6]


class Fuzzer:
    def __init__(self, seed: int, cfg):
        self.rng, self.cfg = random.Random(seed), cfg
        self.gen = torch.Generator().manual_seed(seed)

    def tensors(self, stage: int, method: str) -> dict[str, torch.Tensor]:
        cfg, rng = self.cfg, self.rng
        B, T = rng.randint(1, 4), rng.randint(1, cfg.max_seq_len)
        ids = lambda: torch.randint(0, cfg.vocab_size, (B, T), generator=self.gen)  # noqa: E731
        hidden = lambda: torch.randn(B, T, cfg.d_model, generator=self.gen) * rng.choice([1e-3, 1.0, 30.0])  # noqa: E731
        inputs = ids() if stage == 0 else hidden()
        if method == "Forward":
            return {"inputs": inputs}
        if stage == cfg.n_stages - 1:
            return {"inputs": inputs, "labels": ids()}
        return {"inputs": inputs, "grad_outputs": hidden()}

    @staticmethod
    def encode(name: str, t: torch.Tensor, codec):
        """Poisoned values as the codec encodes them, or raw where it refuses to encode them (piecewise, low-rank)."""
        try:
            return encode_tensor(name, t, codec)
        except (ValueError, RuntimeError):
            return encode_tensor(name, t, get_codec("none"))

    def poison_values(self, tensors: dict[str, torch.Tensor]) -> None:
        name = self.rng.choice(sorted(tensors))
        flat = tensors[name].view(-1)
        for _ in range(self.rng.randint(1, 3)):
            i = self.rng.randrange(flat.numel())
            flat[i] = self.rng.choice(SPECIAL_FLOATS if flat.is_floating_point() else SPECIAL_INTS)

    def poison_header(self, h: pb.TensorHeader) -> None:
        choice = self.rng.randrange(7)
        if choice == 0:
            h.shape[:] = [self.rng.choice([0, 1, 7, 10**9, 2**40]) for _ in range(self.rng.randint(0, 6))]
        elif choice == 1:
            h.dtype = self.rng.randint(0, 40)  # type: ignore[assignment]
        elif choice == 2:
            h.codec = self.rng.randint(0, 40)  # type: ignore[assignment]
        elif choice == 3:
            h.payload_bytes = self.rng.choice([0, 1, h.payload_bytes - 1, h.payload_bytes + 1, 2**40])
        elif choice == 4:
            h.name = self.rng.choice(["", "outputs", "labels", "inputs", "x" * 5000, "\x00\xff"])
        elif choice == 5:
            h.codec_params = self.rng.randbytes(self.rng.randint(0, 64))
        else:
            h.codec = self.rng.choice([pb.CODEC_NONE, pb.CODEC_FLOAT16, pb.CODEC_BLOCKWISE8])  # type: ignore[assignment]

    def stream(self, stage: int, method: str) -> list[bytes]:
        rng = self.rng
        target = stage if rng.random() < 0.9 else rng.randint(-1, 5)
        tensors = self.tensors(stage, method)
        if rng.random() < 0.4:
            self.poison_values(tensors)
        codec = get_codec(rng.choice(["none", "fp16", "blockwise8", "piecewise3", "lowrank2", "topk50+piecewise4"]))
        meta = pb.CallMeta(
            protocol_version=PROTOCOL_VERSION if rng.random() < 0.95 else rng.randint(0, 9),
            microbatch_id="m" * rng.choice([1, 10, 10_000]),
            stage=target,
            reply_codec=rng.choice([pb.CODEC_NONE, pb.CODEC_BLOCKWISE8, pb.CODEC_LOWRANK, 17]),  # type: ignore[arg-type]
        )
        if rng.random() < 0.3:
            meta.reply_codec_name = rng.choice(["piecewise2", "lowrank4", "topk10+fp16", "lowrank0", "x" * 5000, ""])
            meta.reply_epilogue = rng.choice([0.0, 0.25, 1.0, -1.0, 2.0, float("nan"), float("inf")])
        for field, values in (("forward_version", [0, 1, -5, 2**62]), ("global_batch", [0, 1, -1, 2**62])):
            if rng.random() < 0.2:
                setattr(meta, field, rng.choice(values))
        if rng.random() < 0.1:
            meta.admitted_at = rng.choice([0, 3, -2, 2**62])
        encoded = [self.encode(k, v, codec) for k, v in tensors.items()]
        if rng.random() < 0.4:
            self.poison_header(rng.choice(encoded).header)
        frames = list(iter_frames(meta, encoded, chunk_bytes=rng.choice([64, 1000, 1 << 20])))
        mutation = rng.randrange(10)
        if mutation == 0 and len(frames) > 1:
            frames.pop(rng.randrange(len(frames)))  # a missing chunk, header or meta
        elif mutation == 1:
            frames.insert(rng.randrange(len(frames) + 1), rng.randbytes(rng.randint(0, 200)))
        elif mutation == 2:
            i = rng.randrange(len(frames))
            frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]  # truncated
        elif mutation == 3:
            frames.append(frames[-1])  # repeated data or header
        elif mutation == 4:
            rng.shuffle(frames)
        elif mutation == 5:
            frames = []
        elif mutation == 6:  # data flipped in place: blockwise scales, fp16 patterns, ids
            i = rng.randrange(len(frames))
            frame, data = parse_frame(frames[i])
            if len(data):
                buf = bytearray(data)
                for _ in range(rng.randint(1, 8)):
                    buf[rng.randrange(len(buf))] = rng.randrange(256)
                frames[i] = encode_frame(
                    frame.meta if frame.HasField("meta") else None,
                    frame.tensor if frame.HasField("tensor") else None,
                    bytes(buf),
                )
        return frames

    def unary(self) -> tuple[str, bytes]:
        rng = self.rng
        if rng.random() < 0.5:
            return rng.choice(["Info", "Progress"]), rng.randbytes(rng.randint(0, 300))
        if rng.random() < 0.3:
            return "Info", pb.InfoRequest(with_digest=rng.random() < 0.5).SerializeToString()
        msg = pb.StageProgress(
            protocol_version=rng.choice([PROTOCOL_VERSION, 0, 99]),
            stage=rng.randint(-1, 4),
            peer_id=rng.choice(["", "peer", "p" * 1000]),
            epoch=rng.choice([0, 1, 2**62, -1]),
            samples=rng.choice([0, 8, 2**40, -3]),
            end_epoch=rng.random() < 0.5,
            address=rng.choice(["", "127.0.0.1:1", "nonsense", "a" * 400 + ":1"]),
            claims=rng.random() < 0.3,
            lineage=rng.choice(["", "init", "0" * 16, "x" * 16, "l" * 5000]),
            averaged=rng.choice([None, 0, 1, -1, 2**62]),  # above its epoch, or negative: malformed
            recovering=rng.random() < 0.3,
        )
        if rng.random() < 0.3:  # the round it says it is in: below 0, at or past its epoch
            msg.taken_epoch = rng.choice([-1, 0, 1, 2**62])
        for _ in range(rng.choice([0, 0, 1, 3, 40])):  # the admissions behind its count: garbage, and too many
            rng.choice([msg.served, msg.served, msg.taken]).add(
                microbatch_id=rng.choice(["", "mb", "m" * 500]),
                samples=rng.choice([0, 1, 4, -1, 2**41]),
                global_batch=rng.choice([0, 1, -1, 2**62]),
                admitted_at=rng.choice([0, 1, -5]),
                admitted_by=rng.choice(["", "peer", "p" * 500]),
                signature=rng.choice([b"", b"x" * 256, b"y" * 5000]),
            )
        if rng.random() < 0.3:  # stage 0's admission of a later epoch: garbage, not later, unsigned
            msg.moved_on.CopyFrom(
                pb.Admission(
                    microbatch_id=rng.choice(["", "mb", "m" * 500]),
                    samples=rng.choice([0, 4, -1]),
                    global_batch=rng.choice([0, 3, -1]),
                    admitted_at=rng.choice([0, 3, -5, 2**62]),
                    admitted_by=rng.choice(["", "peer", "p" * 500]),
                    signature=rng.choice([b"", b"x" * 256, b"y" * 5000]),
                )
            )
        return "Progress", msg.SerializeToString()


async def call(channel: grpc.aio.Channel, method: str, request) -> tuple[grpc.StatusCode, str]:
    try:
        if isinstance(request, bytes):
            await channel.unary_unary(f"/{SERVICE}/{method}")(request, timeout=10)
        else:
            async for _ in channel.stream_stream(f"/{SERVICE}/{method}")(iter(request), timeout=10):
                pass
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


async def test_fuzzed_calls_get_actionable_statuses_and_leave_every_stage_finite():
    cfg = tiny_test()
    fuzzer = Fuzzer(seed=20261123, cfg=cfg)
    codes: Counter = Counter()
    async with InProcessStages(cfg, samples_per_step=8, max_batch=4) as stages:
        channels = {i: aio_channel(a) for i, a in stages.addresses.items()}
        try:
            for case in range(CASES):
                stage = fuzzer.rng.choice(sorted(stages.addresses))
                if fuzzer.rng.random() < 0.2:
                    method, request = fuzzer.unary()
                else:
                    method = fuzzer.rng.choice(["Forward", "Backward"])
                    request = fuzzer.stream(stage, method)
                code, details = await call(channels[stage], method, request)
                codes[code.name] += 1
                assert code in ACCEPTABLE, f"case {case}: {method} on stage {stage} -> {code} {details!r}"
                assert len(details) <= MAX_STATUS_CHARS + 200, f"case {case}: status of {len(details)} characters"
                for w in stages.workers.values():
                    assert all(torch.isfinite(p).all() for p in w.params), f"case {case}: stage parameters not finite"
                    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in w.params), f"case {case}"
        finally:
            for channel in channels.values():
                await channel.close()
        print(
            f"\n{CASES} fuzzed calls: {dict(codes)}; steps per stage {[w.param_version for w in stages.workers.values()]}"
        )
        assert codes["INVALID_ARGUMENT"] > CASES // 3 and codes["OK"] > CASES // 20, codes
        client = StageClient(CompressionPolicy.for_wire("blockwise8"), WireStats(), max_tensor_bytes=1 << 26)
        loss = await run_microbatch(stages, client, *random_batch(cfg, 4, seed=1))
        await client.close()
        assert math.isfinite(loss)
