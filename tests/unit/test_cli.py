"""Command lines are generated from the config dataclasses, and `to_argv` is their exact inverse: a process started
from a config object parses back to that object, so swarm-local and the deploy files cannot drift from the parsers."""

import dataclasses

import pytest

from server.config import (
    AveragingConfig,
    CheckpointConfig,
    EpochConfig,
    NetworkConfig,
    OptimizerConfig,
    ServerConfig,
)
from server.main import build_parser as server_parser
from swarm.cli import config_from_args, to_argv
from swarm.rebalance import RebalanceConfig
from tools.local import main
from tools.processes import local_server
from trainer.config import TrainerConfig
from trainer.main import build_parser as trainer_parser


def parse(parser, cls, argv):
    return config_from_args(cls, parser.parse_args(argv))


@pytest.mark.parametrize("changed_only", [True, False])
def test_to_argv_round_trips_every_kind_of_field(changed_only):
    server = ServerConfig(
        stage="2",
        network=NetworkConfig(
            initial_peers=["/ip4/1.2.3.4/tcp/5/p2p/X", "/ip4/5.6.7.8/tcp/9/p2p/Y"], announce_host="e.org"
        ),
        optimizer=OptimizerConfig(lr=3.5e-4),
        epochs=EpochConfig(delay_optimizer_step=True),
        checkpoint=CheckpointConfig(checkpoint_dir="/tmp/ck"),
        averaging=AveragingConfig(allreduce_codec="fp16"),
        rebalance=False,
        rebalancing=RebalanceConfig(period_s=7.5, algorithm="paper"),
    )
    assert parse(server_parser(), ServerConfig, to_argv(server, changed_only=changed_only)) == server
    trainer = TrainerConfig(in_flight=7, codec="none", data="corpus.txt", max_steps=11, duration=2.5)
    assert parse(trainer_parser(), TrainerConfig, to_argv(trainer, changed_only=changed_only)) == trainer
    assert to_argv(ServerConfig()) == [] and to_argv(TrainerConfig()) == []


def test_settings_that_cannot_work_together_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="synchronous steps only"):  # a delayed stage never averaged parameters
        ServerConfig(epochs=EpochConfig(delay_optimizer_step=True), averaging=AveragingConfig(param_average_every=2))
    with pytest.raises(ValueError, match="at least twice --averaging-timeout"):
        ServerConfig(epochs=EpochConfig(admission_timeout=5.0), averaging=AveragingConfig(averaging_timeout=10.0))
    ServerConfig(averaging=AveragingConfig(param_average_every=2))


def test_to_argv_relative_to_a_base_config():
    base = local_server(1)
    cfg = dataclasses.replace(base, optimizer=OptimizerConfig(lr=1e-4))
    assert to_argv(cfg, base=base) == ["--lr", "0.0001"]


def test_every_flag_has_help(capsys):
    for parser in (server_parser(), trainer_parser()):
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                assert action.help and not action.help.startswith("(default"), f"{action.option_strings} has no help"
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--servers-per-stage" in capsys.readouterr().out
