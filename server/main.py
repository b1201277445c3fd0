"""`swarm-server`: serve one pipeline stage. Parses flags, starts the DHT node, serves until SIGTERM/SIGINT, then
drains queued requests, withdraws its DHT record and shuts everything down in `finally`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time

import grpc
import torch
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dht.node import SwarmDHT, start_dht
from dht.records import ServerRecord
from server.checkpoint import load_checkpoint, save_checkpoint
from server.collab import LocalSteps, StageCollaboration
from server.config import ServerConfig
from server.service import Collaboration, StageSchema, StageService
from server.worker import StageWorker
from swarm.cli import add_config_args, add_model_args, config_from_args, model_from_args
from swarm.model import Stage
from swarm.wire import GRPC_OPTIONS, SERVICE

logger = logging.getLogger("swarm.server")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    return device


async def choose_stage(sdht: SwarmDHT, n_stages: int) -> int:
    """`--stage auto`: the stage with the least announced capacity (fewest peers breaks ties, then lowest index)."""
    views = [await sdht.discover(i) for i in range(n_stages)]
    capacity = [(sum(e.record.throughput for e in v), len(v), i) for i, v in enumerate(views)]
    return min(capacity)[2]


async def start_grpc(
    service: StageService, host: str, port: int
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """Start the stage service and the standard health service; returns the bound port."""
    server = grpc.aio.server(options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers([service.handler()])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer, bound


async def serve(cfg: ServerConfig, sdht: SwarmDHT, worker: StageWorker, collab: Collaboration,
                stop: asyncio.Event) -> None:  # fmt: skip
    model_cfg, stage_index = worker.stage.cfg, worker.stage.index
    joined = await collab.join()
    if not joined and cfg.checkpoint_dir:
        epoch = await asyncio.to_thread(load_checkpoint, worker, cfg.checkpoint_dir)
        if epoch is not None:
            collab.epoch = epoch
    await collab.start()
    service = StageService(worker, StageSchema(model_cfg, stage_index, cfg.max_batch_size), collab)
    server, health_servicer, port = await start_grpc(service, cfg.host, cfg.port)

    def record() -> ServerRecord:
        return ServerRecord(
            host=cfg.announce_host or cfg.host, port=cfg.announce_port or port, stage=stage_index,
            throughput=worker.throughput, queue_length=worker.queue_length, param_version=worker.param_version,
        )  # fmt: skip

    if isinstance(collab, StageCollaboration):
        collab.address = record().address
    n_params = sum(p.numel() for p in worker.params)
    logger.info("stage %d/%d on %s: %.2fM parameters, epoch %d (%s), serving at %s", stage_index, model_cfg.n_stages,
                worker.device, n_params / 1e6, worker.param_version, "joined peers" if joined else "own start",
                record().address)  # fmt: skip
    last_checkpoint = time.monotonic()
    try:
        while not stop.is_set():
            try:
                await sdht.announce(record(), cfg.record_ttl)
            except Exception as e:  # the DHT may be briefly unreachable; the next period retries
                logger.warning("announce failed: %r", e)
            logger.info("stage %d: epoch %d, %d samples, %.1f samples/s, queue %d, rejected %d, all-reduce %.1f MB",
                        stage_index, worker.param_version, worker.samples_processed, worker.throughput,
                        worker.queue_length, service.requests_rejected, collab.allreduce_bytes / 1e6)  # fmt: skip
            if cfg.checkpoint_dir and time.monotonic() - last_checkpoint > cfg.checkpoint_period:
                last_checkpoint = time.monotonic()
                await asyncio.to_thread(save_checkpoint, worker, cfg.checkpoint_dir, collab.epoch)
            try:
                await asyncio.wait_for(stop.wait(), cfg.announce_period)
            except TimeoutError:
                pass
    finally:
        logger.info("stage %d: shutting down, draining up to %.0fs", stage_index, cfg.drain_timeout)
        await health_servicer.enter_graceful_shutdown()
        try:
            await asyncio.wait_for(sdht.withdraw(record(), cfg.record_ttl), 3)
        except Exception as e:
            logger.warning("could not withdraw the DHT record: %r", e)
        await server.stop(grace=cfg.drain_timeout)
        if cfg.checkpoint_dir:
            await asyncio.to_thread(save_checkpoint, worker, cfg.checkpoint_dir, collab.epoch)
        await collab.stop()
        worker.shutdown()


async def _main(cfg: ServerConfig, sdht: SwarmDHT, worker: StageWorker, collab: Collaboration) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await serve(cfg, sdht, worker, collab, stop)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="swarm-server", description="Serve one SWARM pipeline stage.")
    add_config_args(parser, ServerConfig)
    add_model_args(parser)
    args = parser.parse_args(argv)
    try:
        cfg, model_cfg = config_from_args(ServerConfig, args), model_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if os.environ.get("SWARM_DEBUG"):
        logging.getLogger("server").setLevel(logging.DEBUG)
    if cfg.torch_threads > 0:
        torch.set_num_threads(cfg.torch_threads)
    sdht = SwarmDHT(start_dht(cfg.initial_peers, host=cfg.host, port=cfg.dht_port), cfg.swarm_name)
    try:
        stage = asyncio.run(choose_stage(sdht, model_cfg.n_stages)) if cfg.stage == "auto" else int(cfg.stage)
        worker = StageWorker(Stage(model_cfg, stage), cfg, resolve_device(cfg.device))
        # hivemind's averager forks: build it on the main thread, before the event loop and gRPC start
        collab = LocalSteps(worker, cfg.samples_per_step) if cfg.solo else StageCollaboration(worker, sdht, stage, cfg)
        uvloop.run(_main(cfg, sdht, worker, collab))
    finally:
        sdht.shutdown()


if __name__ == "__main__":
    main()
