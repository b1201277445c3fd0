"""Real grpc.aio stage servers in this process (no DHT), driven by the trainer's own StageClient: enough to count bytes
on the wire and to time the RPC path without process start-up."""

from __future__ import annotations

import torch

from server.collab import LocalSteps
from server.config import ServerConfig
from server.main import start_grpc
from server.service import StageSchema, StageService
from server.worker import StageWorker
from swarm.config import ModelConfig
from swarm.model import Stage
from trainer.client import StageClient


class InProcessStages:
    """One gRPC server per stage on 127.0.0.1. `stages` limits which stage indices get a server."""

    def __init__(
        self, cfg: ModelConfig, device: torch.device, max_batch: int, stages: list[int] | None = None,
        worker_cls: type[StageWorker] = StageWorker,
    ):  # fmt: skip
        self.cfg = cfg
        self.indices = list(range(cfg.n_stages)) if stages is None else stages
        server_cfg = ServerConfig(samples_per_step=10**9, max_batch_size=max_batch)  # never step: grads stay readable
        self.workers = {i: worker_cls(Stage(cfg, i), server_cfg, device) for i in self.indices}
        self.services = {
            i: StageService(w, StageSchema(cfg, i, max_batch), LocalSteps(w, server_cfg.samples_per_step))
            for i, w in self.workers.items()
        }
        self.addresses: dict[int, str] = {}
        self.servers = []

    async def __aenter__(self) -> InProcessStages:
        for i, service in self.services.items():
            server, _, port = await start_grpc(service, "127.0.0.1", 0)
            self.servers.append(server)
            self.addresses[i] = f"127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc) -> None:
        for server in self.servers:
            await server.stop(grace=None)
        for worker in self.workers.values():
            worker.shutdown()


async def run_microbatch(stages: InProcessStages, client: StageClient, tokens: torch.Tensor, labels: torch.Tensor):
    """Forward through every stage, loss at the last, backward in reverse: the calls `Trainer.train_microbatch` makes."""
    cfg, acts = stages.cfg, [tokens]
    hidden = (*tokens.shape, cfg.d_model)
    for s in range(cfg.n_stages - 1):
        acts.append(
            (await client.call(stages.addresses[s], "Forward", s, "m", {"inputs": acts[-1]}, hidden, 120)).tensor
        )
    last = cfg.n_stages - 1
    reply = await client.call(
        stages.addresses[last], "Backward", last, "m", {"inputs": acts[-1], "labels": labels}, hidden, 120
    )
    grad = reply.tensor
    for s in reversed(range(last)):
        tensors = {"inputs": acts[s], "grad_outputs": grad}
        grad = (await client.call(stages.addresses[s], "Backward", s, "m", tensors, hidden if s else None, 120)).tensor
    return reply.loss


def random_batch(cfg: ModelConfig, batch_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (batch_size, cfg.max_seq_len)
    return torch.randint(0, cfg.vocab_size, shape, generator=gen), torch.randint(
        0, cfg.vocab_size, shape, generator=gen
    )
