"""Bad input is refused at start, before any network: in one `PROG: error: ...` line with status 2, as argparse
refuses a bad flag. Each command's `main` runs in this process; one that got past its checks would start its DHT
node, which this folder's conftest refuses."""

import socket

import grpc
import pytest
import torch

from dht.main import main as dht_main
from server.main import main as server_main
from swarm.net import check_ports_free, port_in_use
from trainer.main import main as trainer_main


@pytest.fixture
def grpc_port():
    """A port a gRPC server listens on, as a running swarm-server's does: with SO_REUSEPORT, so that a second gRPC
    server binds it without an error."""
    server = grpc.server(thread_pool=None)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port
    server.stop(None)


def refusal(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.timeout(30)
def test_a_port_a_grpc_server_holds_is_in_use_and_a_free_one_is_not(grpc_port):
    again = grpc.server(thread_pool=None)
    assert again.add_insecure_port(f"127.0.0.1:{grpc_port}") == grpc_port  # what the probe is for
    again.stop(None)
    assert port_in_use("127.0.0.1", grpc_port) and port_in_use("0.0.0.0", grpc_port)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert not port_in_use("127.0.0.1", free)
    check_ports_free("127.0.0.1", {"--port": free, "--dht-port": 0})
    with pytest.raises(ValueError, match=f"--port and --dht-port must differ, both are {free}"):
        check_ports_free("127.0.0.1", {"--port": free, "--dht-port": free})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", ["--port", "--dht-port"])
def test_swarm_server_refuses_a_port_in_use(grpc_port, capsys, flag):
    line = refusal(server_main, [flag, str(grpc_port)], capsys)
    assert line == (
        f"swarm-server: error: {flag} {grpc_port}: port {grpc_port} is in use on 127.0.0.1 (another swarm peer?): "
        "choose another, or 0 for any free port"
    )


@pytest.mark.timeout(60)
def test_swarm_trainer_and_swarm_dht_refuse_a_port_in_use(grpc_port, capsys):
    line = refusal(trainer_main, ["--dht-port", str(grpc_port)], capsys)
    assert line.startswith(f"swarm-trainer: error: --dht-port {grpc_port}: port {grpc_port} is in use"), line
    line = refusal(dht_main, ["--host", "127.0.0.1", "--port", str(grpc_port)], capsys)
    assert line.startswith(f"swarm-dht: error: --port {grpc_port}: port {grpc_port} is in use"), line


@pytest.mark.timeout(60)
def test_swarm_server_refuses_a_stage_the_model_does_not_have(capsys):
    line = refusal(server_main, ["--preset", "local_debug", "--stage", "3"], capsys)
    assert line == "swarm-server: error: --stage 3: the model has 3 stages (--n-stages), 0 to 2"
    line = refusal(server_main, ["--n-stages", "2", "--stage", "2"], capsys)
    assert line == "swarm-server: error: --stage 2: the model has 2 stages (--n-stages), 0 to 1"


@pytest.mark.timeout(60)
def test_swarm_server_refuses_a_device_this_machine_does_not_have(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = refusal(server_main, ["--device", "cuda"], capsys)
    assert line == "swarm-server: error: --device cuda: CUDA is not available on this machine"
    line = refusal(server_main, ["--device", "gpu"], capsys)
    assert line == "swarm-server: error: --device gpu: not a device; give auto, cpu, cuda or cuda:N"


@pytest.mark.timeout(60)
def test_swarm_trainer_refuses_a_missing_data_or_tokenizer_file(tmp_path, capsys):
    missing = tmp_path / "corpus.txt"
    line = refusal(trainer_main, ["--data", str(missing)], capsys)
    assert line == f"swarm-trainer: error: --data {missing}: no such file or folder"
    line = refusal(trainer_main, ["--tokenizer", str(tmp_path / "tok.json")], capsys)
    assert line == f"swarm-trainer: error: --tokenizer {tmp_path / 'tok.json'}: no such file"


@pytest.mark.timeout(60)
def test_swarm_trainer_refuses_a_data_file_that_is_not_text(tmp_path, capsys):
    path = tmp_path / "corpus.parquet"
    path.write_bytes(b"PAR1" * 512)
    line = refusal(trainer_main, ["--data", str(path)], capsys)
    assert line.startswith(f"swarm-trainer: error: --data {path}: a .parquet file would be trained on as raw bytes")
