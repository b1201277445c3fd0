"""swarm-generate: the sampler (pure), sampling from an exported file, and through a live in-process swarm."""

import asyncio
import dataclasses
import functools
import threading

import pytest
import torch
from safetensors.torch import save_file

from dht.node import SwarmDHT, start_dht
from dht.records import ServerRecord
from server.stage_server import StageServer
from swarm.cli import to_argv
from swarm.compression import CompressionPolicy
from swarm.config import model_config
from swarm.model import GPT
from swarm.protocol.tensors import WireStats
from tests.conftest import free_port
from tests.peers import MODEL, SWARM, server_config
from tools.generate import (
    BYTES,
    SwarmPipeline,
    decode,
    load_model,
    main,
    model_next_logits,
    next_token,
    sample,
    swarm_settings,
)
from tools.local import LocalConfig, LocalSwarm, sample_text
from trainer.client import StageClient

TINY = model_config("tiny_test", n_stages=2)
TINY_FLAGS = ["--preset", "tiny_test", "--n-stages", "2", "--device", "cpu"]


def fake_logits(ids) -> torch.Tensor:
    """Logits that depend on the context, as a model's do."""
    return torch.randn(BYTES, generator=torch.Generator().manual_seed(sum(ids) * 31 + len(ids)))


def draw(seed: int, n: int = 50, **kwargs) -> list[int]:
    kwargs = {"temperature": 1.0, "top_k": 0, **kwargs}
    return sample(fake_logits, [1, 2, 3], n, generator=torch.Generator().manual_seed(seed), **kwargs)


def test_the_sampler_is_deterministic_given_its_seed():
    assert draw(0) == draw(0)
    assert draw(0) != draw(1)
    assert len(draw(0, n=7)) == 7 and all(0 <= i < BYTES for i in draw(0))


def test_top_k_draws_only_among_the_k_likeliest():
    logits = torch.randn(BYTES, generator=torch.Generator().manual_seed(0))
    top3 = set(torch.topk(logits, 3).indices.tolist())
    gen = torch.Generator().manual_seed(0)
    drawn = [next_token(logits, 5.0, 3, gen) for _ in range(300)]  # hot: without top-k, anything would come
    assert set(drawn) == top3
    assert {next_token(logits, 5.0, 1, gen) for _ in range(20)} == {int(logits.argmax())}
    ties = torch.zeros(BYTES)  # all tied: still exactly k candidates
    assert len({next_token(ties, 1.0, 2, gen) for _ in range(200)}) == 2


@pytest.mark.parametrize("temperature", [0.0, 1e-4])
def test_temperature_towards_zero_is_the_argmax(temperature):
    greedy = draw(0, temperature=temperature)
    assert greedy == draw(1, temperature=temperature)
    ids = [1, 2, 3]
    for token in greedy:
        assert token == int(fake_logits(ids).argmax())
        ids.append(token)


def test_bad_logits_are_refused():
    gen = torch.Generator()
    with pytest.raises(ValueError, match="NaN or infinite"):
        next_token(torch.tensor([0.0, float("nan")]), 1.0, 0, gen)
    with pytest.raises(ValueError, match="vector"):
        next_token(torch.zeros(2, 3), 1.0, 0, gen)


@pytest.fixture
def exported(tmp_path):
    """A tiny random GPT saved as swarm-export writes it (keys `stages.{i}.{name}`); initialised from another seed than
    the flags' model, so that only weights read from the file can reproduce it."""
    model = GPT(dataclasses.replace(TINY, seed=7))
    assert all(k.startswith(("stages.0.", "stages.1.")) for k in model.state_dict())
    path = tmp_path / "model.safetensors"
    save_file(model.state_dict(), str(path))
    return path, model


def test_generate_from_an_exported_file(exported, capsys):
    path, model = exported
    prompt = "def fibonacci(n): return "  # longer than tiny_test's 16 tokens: the context is cropped
    main(["--model", str(path), *TINY_FLAGS, "--prompt", prompt, "--max-new-bytes", "30", "--seed", "3"])
    out = capsys.readouterr().out
    ids = list(prompt.encode())
    expected = sample(model_next_logits(model), ids, 30, 0.8, 40, torch.Generator().manual_seed(3))
    assert out == decode(ids + expected) + "\n"
    assert out.startswith(prompt)


def test_greedy_generation_from_a_file_is_the_models_argmax(exported):
    path, model = exported
    loaded = load_model(path, TINY)
    ids = list(b"import ")
    new = sample(model_next_logits(loaded), ids, 10, 0.0, 0, torch.Generator())
    for token in new:  # GPT.forward returns the loss: the logits, stage by stage
        h = torch.tensor([ids[-TINY.max_seq_len :]])
        with torch.no_grad():
            for stage in model.stages:
                h = stage(h)
        assert token == int(h[0, -1, :BYTES].argmax())
        ids.append(token)


@pytest.mark.parametrize(
    "setup, flags, message",
    [
        ("missing", [], "no such file"),
        ("garbage", [], "not a readable safetensors file"),
        ("model", ["--d-model", "64", "--n-heads", "2"], "does not fit the model of these flags"),
        ("model", ["--n-stages", "3"], "missing"),
    ],
)
def test_a_bad_file_or_wrong_model_flags_fail_with_a_clear_error(exported, tmp_path, capsys, setup, flags, message):
    path = {"missing": tmp_path / "nope.safetensors", "model": exported[0]}.get(setup, tmp_path / "garbage")
    (tmp_path / "garbage").write_bytes(b"this is not a safetensors file")
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(path), *TINY_FLAGS, *flags])
    assert exit_info.value.code not in (0, None)
    err = str(exit_info.value.code)
    assert message in err and str(path) in err


@pytest.mark.parametrize(
    "flags, message",
    [
        ([], "either --model FILE or --initial-peers"),
        (["--model", "m", "--initial-peers", "/ip4/127.0.0.1/tcp/1"], "exactly one"),
        (["--model", "m", "--temperature", "-1"], "--temperature"),
        (["--model", "m", "--prompt", ""], "--prompt"),
        (["--model", "m", "--vocab-size", "100", "--prompt", "é"], "--vocab-size"),
    ],
)
def test_bad_flags_are_refused_with_a_message(flags, message, capsys):
    with pytest.raises(SystemExit):
        main(flags)
    assert message in capsys.readouterr().err


async def start_stage(initial_peers: list[str], stage: int) -> StageServer:
    """A real stage peer (gRPC + DHT record) that steps alone: no averager to start."""
    loop = asyncio.get_running_loop()
    sdht = await loop.run_in_executor(None, SwarmDHT.start, SWARM, initial_peers)
    cfg = server_config(initial_peers)
    cfg = dataclasses.replace(cfg, stage=str(stage), epochs=dataclasses.replace(cfg.epochs, solo=True))
    server = StageServer(cfg, MODEL, sdht, torch.device("cpu"))
    await server.enter(stage)
    return server


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_generate_through_a_live_swarm_matches_the_local_model(capsys, marker):
    """Two stage peers and a dead server that claims to be the fastest of stage 0. Their parameters are the shared
    initialisation, so the swarm's logits must be the local GPT's: codec "none" sends fp32 exactly, and the same ops
    run in both places (1e-5: only the order of float sums may differ)."""
    loop = asyncio.get_running_loop()
    boot = await loop.run_in_executor(None, functools.partial(start_dht, swarm_name=SWARM))
    dhts, servers = [], []
    try:
        peers = [str(m) for m in boot.get_visible_maddrs()]
        args = ["--initial-peers", *peers, "--swarm-name", SWARM, "--preset", "local_debug"]
        args += to_argv(MODEL, base=model_config("local_debug"))
        with pytest.raises(SystemExit, match="no live server of stage 0"):  # a swarm with no servers yet
            await asyncio.to_thread(main, [*args, "--max-new-bytes", "1"])
        for stage in range(MODEL.n_stages):
            servers.append(await start_stage(peers, stage))
        liar = await loop.run_in_executor(None, SwarmDHT.start, SWARM, peers)
        dhts.append(liar)
        dead = ServerRecord(host="127.0.0.1", port=free_port(), stage=0, throughput=1e9)
        assert await liar.announce(dead, ttl=60)
        client = await loop.run_in_executor(
            None, functools.partial(SwarmDHT.start, SWARM, peers, swarm_settings(MODEL), client_mode=True)
        )
        dhts.append(client)

        deadline = loop.time() + 30
        while [len(await client.discover(s)) for s in range(MODEL.n_stages)] != [2, 1]:
            assert loop.time() < deadline, "timed out waiting for every record to be listed"
            await asyncio.sleep(0.2)

        local = model_next_logits(GPT(MODEL).eval())
        client_rpc = StageClient(CompressionPolicy.for_wire("none"), WireStats(), 1 << 20)
        pipeline = SwarmPipeline(client, MODEL, client_rpc, timeout=10)
        try:
            for prompt in (b"d", b"def main():\n    return 42"):  # the second is cropped to max_seq_len
                torch.testing.assert_close(
                    await pipeline.next_logits(list(prompt)), local(list(prompt)), atol=1e-5, rtol=0
                )
            assert len(pipeline.failed) == 1  # the dead server was tried first (fastest), then passed over
        finally:
            await client_rpc.close()

        # the command line, end to end (in a thread: it runs its own event loop)
        await asyncio.to_thread(main, [*args, "--prompt", "def ", "--max-new-bytes", "12", "--temperature", "0"])
        out = capsys.readouterr().out
        assert out.startswith("def ")
        expected = sample(local, list(b"def "), 12, 0.0, 0, torch.Generator())
        assert out == decode(list(b"def ") + expected) + "\n"
    finally:
        for server in reversed(servers):
            await server.shutdown()
            server.sdht.shutdown()
        for sdht in dhts:
            sdht.shutdown()
        boot.shutdown()


@pytest.mark.parametrize("peers, message", [([], "could not start"), (["/ip4/127.0.0.1/tcp/9"], "exited with 1")])
def test_swarm_local_warns_instead_of_failing_when_it_cannot_sample(tmp_path, capsys, marker, peers, message):
    swarm = LocalSwarm(tmp_path / "logs")
    swarm.initial_peers = peers
    with swarm:
        assert sample_text(swarm, LocalConfig(sample_bytes=5), threading.Event()) is None
    out = capsys.readouterr().out
    assert "swarm-local: warning: no sample:" in out and message in out
