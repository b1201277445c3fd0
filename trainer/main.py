"""`swarm-trainer`: feeds microbatches through the swarm. Holds no parameters and needs no GPU."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

import torch
import uvloop

from dht.node import SwarmDHT
from dht.records import settings
from swarm import stacks
from swarm.cli import (
    add_config_args,
    add_config_file_arg,
    add_model_args,
    config_from_args,
    parse_args,
    pipeline_model_from_args,
)
from swarm.config import ModelConfig
from swarm.net import check_ports_free
from swarm.protocol import access
from trainer.config import TrainerConfig
from trainer.data import batches, check_paths
from trainer.trainer import Trainer

logger = logging.getLogger("swarm.trainer")


async def _main(cfg: TrainerConfig, model_cfg: ModelConfig, sdht: SwarmDHT) -> dict:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stacks.dump_on_signal(loop)  # kill -USR1: what this process is doing
    data = batches(
        cfg.data,
        batch_size=cfg.batch_size,
        seq_len=model_cfg.max_seq_len,
        seed=cfg.data_seed,
        vocab_size=model_cfg.vocab_size,
        tokenizer=cfg.tokenizer,
        column=cfg.data_column,
        split=cfg.data_split,
    )
    try:
        return await Trainer(cfg, model_cfg, sdht, data).run(stop)
    finally:
        await sdht.close_p2p()  # opened if a server was reached over libp2p: its unix socket goes with it


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm-trainer", description=__doc__)
    add_config_file_arg(parser)
    add_config_args(parser, TrainerConfig)
    add_model_args(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(parser, argv)
    try:
        cfg, model_cfg = config_from_args(TrainerConfig, args), pipeline_model_from_args(args)
        swarm_key = access.load(cfg.swarm_key)
        check_paths(cfg.data, cfg.tokenizer)
        check_ports_free("127.0.0.1", {"--dht-port": cfg.dht_port})  # where its DHT node listens (start_dht)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)  # the trainer only slices data and runs codecs
    shared = settings(model=model_cfg.shared())  # servers whose model differs are not called
    sdht = SwarmDHT.start(
        cfg.swarm_name,
        cfg.initial_peers,
        shared,
        port=cfg.dht_port,
        client_mode=True,
        wait_timeout=cfg.dht_wait_timeout,
        swarm_key=swarm_key,
    )
    try:
        final = uvloop.run(_main(cfg, model_cfg, sdht))
        logger.info(
            "done: %d microbatches, %d lost, %d retries", final["steps"], final["lost_microbatches"], final["retries"]
        )
    finally:
        sdht.shutdown()


if __name__ == "__main__":
    main()
