"""Command lines are generated from the config dataclasses, and `to_argv` is their exact inverse: a process started
from a config object parses back to that object, so swarm-local and the deploy files cannot drift from the parsers."""

import dataclasses

from server.config import (
    ServerConfig,
)
from server.main import build_parser as server_parser
from tests.unit.test_cli import parse
from tools.local import LocalConfig
from tools.processes import LocalSwarm
from trainer.config import TrainerConfig
from trainer.main import build_parser as trainer_parser


def test_swarm_local_starts_exactly_the_configs_it_describes(tmp_path, monkeypatch):
    """The argv swarm-local hands each server and trainer parses back to `LocalConfig.server_config` / `trainer_config`."""
    cfg = LocalConfig(lr=1e-4, samples_per_step=48, in_flight=2, codec="fp16", allreduce_codec="none", trainers=1)
    swarm = LocalSwarm(tmp_path, "cli", ["--preset", "tiny_test"])
    started = {}
    monkeypatch.setattr(swarm, "spawn", lambda name, module, args: started.setdefault(name, (module, args)))
    swarm.initial_peers = ["/ip4/127.0.0.1/tcp/1/p2p/Z"]
    from tools.local import start_peers

    start_peers(swarm, cfg)
    module, argv = started["server-s1-r0"]
    assert module == "server.main"
    server = cfg.server_config(1)
    network = dataclasses.replace(server.network, swarm_name="cli", initial_peers=swarm.initial_peers)
    expected = dataclasses.replace(server, network=network)
    assert parse(server_parser(), ServerConfig, argv) == expected
    module, argv = started["trainer-0"]
    expected = dataclasses.replace(
        cfg.trainer_config(0),
        swarm_name="cli",
        initial_peers=swarm.initial_peers,
        stats_file=str(tmp_path / "trainer-0.json"),
    )
    assert parse(trainer_parser(), TrainerConfig, argv) == expected
