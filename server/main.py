"""`swarm-server`: serve a pipeline stage, and move to another when the swarm needs it more. Parses flags, starts the
DHT node, serves until SIGTERM/SIGINT, then drains queued requests, withdraws its DHT record and shuts everything down
in `finally`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

import torch
import uvloop

from dht.node import SwarmDHT
from dht.records import settings
from server.collab import compat
from server.config import ServerConfig
from server.stage_server import StageServer
from swarm import stacks
from swarm.cli import (
    add_config_args,
    add_config_file_arg,
    add_model_args,
    config_from_args,
    parse_args,
    pipeline_model_from_args,
)
from swarm.devices import resolve_device
from swarm.net import check_ports_free
from swarm.protocol import access


async def _main(server: StageServer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stacks.dump_on_signal(loop)  # kill -USR1: what this process is doing
    await server.run(stop)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm-server", description="Serve one SWARM pipeline stage.")
    add_config_file_arg(parser)
    add_config_args(parser, ServerConfig)
    add_model_args(parser)
    return parser


def check_start(cfg: ServerConfig, n_stages: int) -> None:
    """ValueError, naming the flag, for what would fail only after the DHT node started: a --stage the model does not
    have, a --port or --dht-port already in use."""
    if cfg.stage != "auto" and int(cfg.stage) >= n_stages:
        raise ValueError(f"--stage {cfg.stage}: the model has {n_stages} stages (--n-stages), 0 to {n_stages - 1}")
    net = cfg.network
    check_ports_free(net.host, {"--port": net.port, "--dht-port": 0 if net.dht_no_listen else net.dht_port})


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(parser, argv)
    try:
        cfg, model_cfg = config_from_args(ServerConfig, args), pipeline_model_from_args(args)
        swarm_key = access.load(cfg.network.swarm_key)
        device = resolve_device(cfg.compute.device)
        check_start(cfg, model_cfg.n_stages)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # SWARM_DEBUG: "1" for every server module, or loggers, e.g. "server.service,server.collab"
    if debug := os.environ.get("SWARM_DEBUG"):
        for name in ["server"] if debug == "1" else debug.split(","):
            logging.getLogger(name).setLevel(logging.DEBUG)
    if cfg.compute.torch_threads > 0:
        torch.set_num_threads(cfg.compute.torch_threads)
    compat.install()  # hivemind's codec table, before any averager forks (server/collab/compat/__init__.py)
    shared = settings(
        model=model_cfg.shared(),
        optimizer=cfg.optimizer,
        epochs={k: getattr(cfg.epochs, k) for k in ("samples_per_step", "lookahead_samples", "delay_optimizer_step")},
        averaging=cfg.averaging.shared,
    )
    sdht = SwarmDHT.start(
        cfg.network.swarm_name,
        cfg.network.initial_peers,
        shared,
        host=cfg.network.host,
        port=cfg.network.dht_port,
        wait_timeout=cfg.network.dht_wait_timeout,
        swarm_key=swarm_key,
        relay="no-listen" if cfg.network.dht_no_listen else "reserve",
    )
    try:
        uvloop.run(_main(StageServer(cfg, model_cfg, sdht, device)))
    finally:
        sdht.shutdown()


if __name__ == "__main__":
    main()
