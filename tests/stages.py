"""Real grpc.aio stage servers in this process, one per stage, no DHT: enough to exercise transport, validation and
the stage math, to inspect gradients, and to count bytes and time the RPC path without process start-up. Used by the
tests and the benchmarks alike."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import torch

from server.collab import SoloSteps
from server.config import ComputeConfig, OptimizerConfig
from server.schema import StageSchema
from server.service import StageService
from server.worker import StageWorker
from swarm.compression import get_codec
from swarm.config import ModelConfig
from swarm.model import Stage
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.frames import iter_frames
from swarm.protocol.rpc import PROTOCOL_VERSION, SERVICE, aio_channel, stage_handler, start_stage_server
from swarm.protocol.tensors import encode_tensor
from trainer.client import StageClient
from trainer.schedule import train_microbatch

CPU = torch.device("cpu")


@contextlib.asynccontextmanager
async def hanging_stage_server() -> AsyncIterator[tuple[str, asyncio.Event]]:
    """A stage server on 127.0.0.1 whose every call hangs, as a frozen peer's do to its callers (its connection stays
    up and answers pings). Yields its address and an event set once a call has come."""
    called = asyncio.Event()

    async def hang(request, context):
        called.set()
        await asyncio.sleep(3600)

    server, _, port = await start_stage_server(stage_handler(hang, hang, hang, hang), "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{port}", called
    finally:
        await server.stop(0)


class InProcessStages:
    """One gRPC server per stage on 127.0.0.1; `stages` limits which stage indices get one. Workers, services and
    addresses are keyed by stage index. With the default `samples_per_step` they never step: gradients stay readable."""

    def __init__(
        self,
        cfg: ModelConfig,
        device: torch.device = CPU,
        max_batch: int = 8,
        samples_per_step: int = 10**9,
        stages: list[int] | None = None,
        worker_cls: type[StageWorker] = StageWorker,
    ):
        self.cfg = cfg
        self.indices = list(range(cfg.n_stages)) if stages is None else stages
        compute = ComputeConfig(max_batch_size=max_batch)
        self.workers = {i: worker_cls(Stage(cfg, i), OptimizerConfig(), compute, device) for i in self.indices}
        self.services = {
            i: StageService(w, StageSchema(cfg, i, max_batch), SoloSteps(w, samples_per_step))
            for i, w in self.workers.items()
        }
        self.addresses: dict[int, str] = {}
        self.servers = []

    async def __aenter__(self) -> InProcessStages:
        for i, service in self.services.items():
            server, _, port = await start_stage_server(service.handler(), "127.0.0.1", 0)
            self.servers.append(server)
            self.addresses[i] = f"127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc) -> None:
        for server in self.servers:
            await server.stop(grace=None)
        for worker in self.workers.values():
            worker.shutdown()


async def run_microbatch(stages: InProcessStages, client: StageClient, tokens: torch.Tensor, labels: torch.Tensor):
    """The trainer's schedule (trainer/schedule.py) through these servers, with no routing: returns the loss."""

    async def call(stage, method, tensors, expect, forward_version, admission):
        address = stages.addresses[stage]
        return await client.call(
            address, method, stage, "m", tensors, expect, 120, forward_version, admission=admission
        )

    return (await train_microbatch(call, stages.cfg.n_stages, stages.cfg.boundary_width, tokens, labels)).loss


def random_batch(cfg: ModelConfig, batch_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (batch_size, cfg.max_seq_len)
    return (
        torch.randint(0, cfg.vocab_size, shape, generator=gen),
        torch.randint(0, cfg.vocab_size, shape, generator=gen),
    )


async def raw_call(address: str, method: str, frames_or_bytes: list, timeout: float = 10) -> list[pb.Frame]:
    """One Forward or Backward call with hand-made frames (serialized or `pb.Frame`s) -> the reply's frames."""
    async with aio_channel(address) as channel:
        serializer = None if frames_or_bytes and isinstance(frames_or_bytes[0], bytes) else pb.Frame.SerializeToString
        rpc = channel.stream_stream(
            f"/{SERVICE}/{method}", request_serializer=serializer, response_deserializer=pb.Frame.FromString
        )
        return [f async for f in rpc(iter(frames_or_bytes), timeout=timeout)]


def frames(stage: int, tensors: dict[str, torch.Tensor], codec: str = "none") -> list[bytes]:
    """A well-formed call's serialized frames."""
    meta = pb.CallMeta(protocol_version=PROTOCOL_VERSION, microbatch_id="x", stage=stage)
    return list(iter_frames(meta, [encode_tensor(k, v, get_codec(codec)) for k, v in tensors.items()]))
