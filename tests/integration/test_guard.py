"""A stage fails closed: requests with values no healthy activation or gradient has are refused before they touch the
model, outlier gradients are not accumulated, a step never leaves the parameters non-finite, a stranger's optimizer
settings are not loaded, and malformed or oversized calls get a short INVALID_ARGUMENT (never UNKNOWN). Real grpc.aio
servers on 127.0.0.1 in this process (tests/stages.py)."""

import asyncio
import contextlib
import gc

import grpc
import pytest
import torch

from swarm.compression import CompressionPolicy, get_codec
from swarm.config import tiny_test
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.frames import Busy, iter_frames
from swarm.protocol.rpc import PROTOCOL_VERSION, SERVICE, aio_channel, stage_handler, start_stage_server
from swarm.protocol.tensors import WireError, WireStats, encode_tensor
from tests.stages import InProcessStages
from trainer.client import StageClient

pytestmark = pytest.mark.timeout(120)


async def test_a_stream_that_stops_sending_is_ended_and_reserved_nothing():
    """A header declaring the largest tensor the stage takes, then silence, with no deadline: the server ends the
    call after its read limit (DEADLINE_EXCEEDED); buffers grow with the data that arrives, so it
    reserved nothing for the declared tensor."""
    cfg = tiny_test()
    async with InProcessStages(cfg, stages=[1], max_batch=8) as stages:
        stages.services[1].max_read_s = 1.0
        meta = pb.CallMeta(protocol_version=PROTOCOL_VERSION, stage=1)
        header = pb.TensorHeader(
            name="inputs",
            dtype=pb.DTYPE_FLOAT32,
            shape=[8, cfg.max_seq_len, cfg.d_model],
            payload_bytes=8 * cfg.max_seq_len * cfg.d_model * 4,
        )

        async def header_then_silence():
            yield pb.Frame(meta=meta, tensor=header).SerializeToString()
            await asyncio.sleep(30)

        async with aio_channel(stages.addresses[1]) as channel:
            call = channel.stream_stream(f"/{SERVICE}/Forward")(header_then_silence())
            started = asyncio.get_running_loop().time()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in call:
                    pass
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value
            assert asyncio.get_running_loop().time() - started < 10


async def test_the_trainer_bans_a_server_that_replies_with_garbage():
    """A server whose reply is out of bounds, NaN, or carries a negative loss: the client raises WireError (the
    trainer's retry loop bans the peer on it)."""
    cfg = tiny_test()
    B, T, D = 2, cfg.max_seq_len, cfg.d_model
    replies = iter([torch.full((B, T, D), 1e6), torch.full((B, T, D), float("nan"))])

    async def forward(raw_frames, context):
        async for _ in raw_frames:
            pass
        meta = pb.CallMeta(protocol_version=PROTOCOL_VERSION, stage=1)
        for frame in iter_frames(meta, [encode_tensor("outputs", next(replies), get_codec("none"))]):
            yield frame

    async def backward(raw_frames, context):
        async for _ in raw_frames:
            pass
        yield pb.Frame(
            meta=pb.CallMeta(protocol_version=PROTOCOL_VERSION, loss=-1.0, has_loss=True)
        ).SerializeToString()

    server, _, port = await start_stage_server(stage_handler(forward, backward, None, None), "127.0.0.1", 0)
    client = StageClient(CompressionPolicy.for_wire("none"), WireStats(), max_tensor_bytes=1 << 26)
    try:
        for expected in ("outside", "outside"):
            with pytest.raises(WireError, match=expected):
                await client.call(
                    f"127.0.0.1:{port}", "Forward", 1, "m", {"inputs": torch.randn(B, T, D)}, (B, T, D), 10
                )
        with pytest.raises(WireError, match="loss"):
            await client.call(
                f"127.0.0.1:{port}",
                "Backward",
                2,
                "m",
                {"inputs": torch.randn(B, T, D), "labels": torch.zeros(B, T, dtype=torch.int64)},
                None,
                10,
            )
    finally:
        await client.close()
        await server.stop(grace=None)


async def test_refused_calls_leave_no_garbage_cycle_holding_their_payload():
    """A call refused mid-read (busy, malformed) must free its payload when it ends, not when the garbage collector
    next scans the oldest generation: on a real server that took tens of seconds and a flood of refusals raised its
    RSS by hundreds of MB (tests/benchmarks/bench_flood.py). Nothing the collector finds may hold payload bytes."""
    cfg = tiny_test()
    B, T, D = 4, cfg.max_seq_len, cfg.d_model
    encoded = encode_tensor("inputs", torch.randn(B, T, D), get_codec("none"))
    meta = pb.CallMeta(protocol_version=PROTOCOL_VERSION, stage=1)
    chunks = list(iter_frames(meta, [encoded], chunk_bytes=len(encoded.payload) // 4))
    malformed = [*chunks[:-1], chunks[-1][:-7]]
    async with InProcessStages(cfg, stages=[1], max_batch=B) as stages:
        service = stages.services[1]
        # one request at a time (with the frame it reads next): the rest are refused while sending
        service.budget.limit = len(encoded.payload) + service.schema.forward_limits.frame_bytes
        service.budget.caller_share = 1.0

        async def one(channel, stream: list[bytes]) -> None:
            async def slow():
                for chunk in stream:
                    yield chunk
                    await asyncio.sleep(0.05)

            with contextlib.suppress(grpc.aio.AioRpcError):
                async for _ in channel.stream_stream(f"/{SERVICE}/Forward")(slow(), timeout=30):
                    pass

        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            async with aio_channel(stages.addresses[1]) as channel:
                await asyncio.gather(*(one(channel, chunks) for _ in range(8)))  # one served, the rest busy
                for _ in range(3):
                    await one(channel, malformed)
            await asyncio.sleep(0.2)
            gc.collect()
            refused = [o for o in gc.garbage if isinstance(o, Busy | WireError)]
            held = [
                r
                for o in gc.garbage
                for r in gc.get_referents(o)
                if isinstance(r, bytes | bytearray | memoryview) and len(r) >= len(chunks[1]) // 2
            ]
            assert service.requests_busy > 0 and service.requests_rejected > 0
            assert not refused and not held, (len(refused), len(held))
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
