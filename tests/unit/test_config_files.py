"""Every command reads its flags from `--config FILE` (TOML) with the command line overriding the file, refuses a file
it cannot use with a message that names the file and the problem, and documents every flag in `--help`."""

import dataclasses
import importlib
import importlib.util
import re
import signal
import tomllib
from pathlib import Path

import pytest
import tomli_w

import tools.local as local
from server.config import NetworkConfig, OptimizerConfig, ServerConfig
from server.export import build_parser as export_parser
from server.main import build_parser as server_parser
from swarm.cli import config_from_args, config_values, model_from_args, parse_args, write_config_file
from swarm.config import model_config
from swarm.rebalance import RebalanceConfig
from tools.local import LocalConfig
from tools.simulate import build_parser as simulate_parser
from trainer.config import TrainerConfig
from trainer.main import build_parser as trainer_parser

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
SCRIPTS = tomllib.loads(PYPROJECT.read_text())["project"]["scripts"]  # the commands as installed: name -> module:main


def command_parser(name: str):
    module_name = SCRIPTS[name].split(":")[0]
    if importlib.util.find_spec(module_name) is None:
        pytest.skip(f"{module_name} does not exist yet")
    return importlib.import_module(module_name).build_parser()


def write_toml(path: Path, values: dict) -> str:
    path.write_text(tomli_w.dumps(values))
    return str(path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_flag_of_every_command_has_help(name):
    parser = command_parser(name)
    for action in parser._actions:
        if action.dest == "help":
            continue
        text = re.sub(r"\s*\(default: .*\)$", "", action.help or "").strip()
        assert text, f"{name} {'/'.join(action.option_strings)} has no help"
    assert parser.format_help()  # argparse %-formats every help string: a stray % raises here


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_command_takes_a_config_file(name):
    parser = command_parser(name)
    assert "--config" in parser._option_string_actions


@pytest.mark.timeout(30)
def test_a_file_sets_what_the_same_flags_set(tmp_path):
    """Both key spellings, every kind of flag (scalar, list, on/off, choice), a nested section's flat flags and the
    model flags."""
    path = write_toml(
        tmp_path / "server.toml",
        {
            "stage": "auto",
            "initial-peers": ["/ip4/1.2.3.4/tcp/5/p2p/X", "/ip4/5.6.7.8/tcp/9/p2p/Y"],
            "lr": 3.5e-4,
            "warmup_steps": 10,
            "allreduce_codec": "fp16",
            "delay-optimizer-step": True,
            "rebalance": False,
            "rebalance-period-s": 7.5,
            "rebalance_algorithm": "paper",
            "preset": "tiny_test",
            "n-stages": 2,
        },
    )
    flags = [
        *("--stage", "auto", "--initial-peers", "/ip4/1.2.3.4/tcp/5/p2p/X", "/ip4/5.6.7.8/tcp/9/p2p/Y"),
        *("--lr", "3.5e-4", "--warmup-steps", "10", "--allreduce-codec", "fp16", "--delay-optimizer-step"),
        *("--no-rebalance", "--rebalance-period-s", "7.5", "--rebalance-algorithm", "paper"),
        *("--preset", "tiny_test", "--n-stages", "2"),
    ]
    from_file, from_flags = parse_args(server_parser(), ["--config", path]), server_parser().parse_args(flags)
    assert config_from_args(ServerConfig, from_file) == config_from_args(ServerConfig, from_flags)
    assert model_from_args(from_file) == model_from_args(from_flags) == model_config("tiny_test", n_stages=2)
    assert config_from_args(ServerConfig, from_file).rebalancing == RebalanceConfig(period_s=7.5, algorithm="paper")


@pytest.mark.timeout(30)
def test_flags_override_the_file(tmp_path):
    path = write_toml(
        tmp_path / "trainer.toml",
        {"batch-size": 16, "in-flight": 5, "initial-peers": ["/ip4/1.2.3.4/tcp/5/p2p/X"], "codec": "fp16"},
    )
    args = parse_args(trainer_parser(), ["--in-flight", "2", "--config", path, "--initial-peers", "A", "B"])
    cfg = config_from_args(TrainerConfig, args)
    assert (cfg.batch_size, cfg.in_flight, cfg.initial_peers, cfg.codec) == (16, 2, ["A", "B"], "fp16")
    assert config_from_args(TrainerConfig, parse_args(trainer_parser(), [])) == TrainerConfig()


@pytest.mark.timeout(30)
def test_a_written_config_reads_back_to_the_same_config(tmp_path):
    server = ServerConfig(
        stage="2",
        network=NetworkConfig(initial_peers=["/ip4/1.2.3.4/tcp/5/p2p/X"], announce_host="e.org"),
        optimizer=OptimizerConfig(lr=3.5e-4),
        rebalance=False,
        rebalancing=RebalanceConfig(period_s=7.5, algorithm="paper"),
    )
    write_config_file(tmp_path / "server.toml", config_values(server))
    args = parse_args(server_parser(), ["--config", str(tmp_path / "server.toml")])
    assert config_from_args(ServerConfig, args) == server
    assert "announce-port" not in config_values(server)  # None: left at its default, as TOML has no null


@pytest.mark.timeout(30)
def test_required_flags_may_come_from_the_file(tmp_path):
    path = write_toml(tmp_path / "export.toml", {"checkpoint-dir": ["a", "b"], "out": "model.safetensors"})
    args = parse_args(export_parser(), ["--config", path])
    assert (args.checkpoint_dir, args.out) == (["a", "b"], "model.safetensors")


@pytest.mark.timeout(30)
def test_simulator_flags_from_a_file(tmp_path):
    """Hand-written flags: a store_true switch, a list of floats, an optional override."""
    path = write_toml(tmp_path / "sim.toml", {"quick": True, "periods": [60, 30.5], "rebalance-hysteresis": 0.2})
    args = parse_args(simulate_parser(), ["--config", path])
    assert (args.quick, args.periods, args.rebalance_hysteresis) == (True, [60.0, 30.5], 0.2)
    path = write_toml(tmp_path / "sim.toml", {"quick": False})
    assert parse_args(simulate_parser(), ["--config", path, "--quick"]).quick is True


@pytest.mark.timeout(30)
def test_swarm_local_write_config_then_config_reproduces_the_run(tmp_path, monkeypatch):
    started: list[LocalConfig] = []
    monkeypatch.setattr(local, "run", lambda cfg, stop: started.append(cfg))
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # main must not take over pytest's Ctrl-C
    path = str(tmp_path / "run.toml")
    argv = ["--stages", "2", "--servers-per-stage", "2,1", "--lr", "1e-4", "--no-allreduce-error-feedback"]
    local.main([*argv, "--log-dir", str(tmp_path / "logs"), "--write-config", path])
    local.main(["--config", path])
    assert started[0] == started[1]
    assert started[0] == dataclasses.replace(
        LocalConfig(stages=2, servers_per_stage="2,1", lr=1e-4, allreduce_error_feedback=False),
        log_dir=str(tmp_path / "logs"),
    )
    assert tomllib.loads(Path(path).read_text())["servers-per-stage"] == "2,1"
    local.main(["--config", path, "--trainers", "3"])
    assert started[2] == dataclasses.replace(started[0], trainers=3)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "content, message",
    [
        (
            "batch-sise = 16",
            "unknown key 'batch-sise': swarm-trainer has no flag --batch-sise (did you mean 'batch-size'?)",
        ),
        ("batch-size = 'eight'", "batch-size = 'eight': must be an integer"),
        ("batch_size = 2.5", "batch_size = 2.5: must be an integer"),
        ("lr = 0.1", "unknown key 'lr'"),
        ("request-timeout = true", "request-timeout = True: must be a number"),
        ("initial-peers = '/ip4/1.2.3.4/tcp/5/p2p/X'", "must be a list"),
        ("swarm-name = ['a', 'b']", "must be a single value, not a list"),
        ("codec = 'zstd'", "codec = 'zstd': must be one of"),
        ("metrics-port = { port = 1 }", "must be an integer"),
        ("batch-size = 8\nbatch_size = 16", "'batch-size' and 'batch_size' set the same flag"),
        ("help = true", "unknown key 'help'"),
        ("config = 'other.toml'", "unknown key 'config'"),
        ("batch-size = ", "not valid TOML"),
        ("[batch-size", "not valid TOML"),
    ],
)
def test_a_bad_file_is_refused_naming_the_file_and_the_problem(tmp_path, capsys, content, message):
    path = tmp_path / "bad.toml"
    path.write_text(content)
    with pytest.raises(SystemExit) as exit:
        parse_args(trainer_parser(), ["--config", str(path)])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert f"--config {path}: " in err and message in err, err


@pytest.mark.timeout(30)
def test_a_bad_on_off_value_is_refused(tmp_path, capsys):
    path = write_toml(tmp_path / "bad.toml", {"delay-optimizer-step": "yes"})
    with pytest.raises(SystemExit):
        parse_args(server_parser(), ["--config", path])
    assert "delay-optimizer-step = 'yes': must be true or false" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_a_missing_file_is_refused_without_a_traceback(tmp_path, capsys):
    for path, why in ((tmp_path / "nope.toml", "No such file or directory"), (tmp_path, "Is a directory")):
        with pytest.raises(SystemExit) as exit:
            parse_args(trainer_parser(), ["--config", str(path)])
        assert exit.value.code == 2
        assert f"swarm-trainer: error: --config {path}: {why}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(trainer_parser(), ["--config"])
    assert "--config: expected one argument" in capsys.readouterr().err
