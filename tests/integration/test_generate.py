"""swarm-generate: the sampler (pure), sampling from an exported file, and through a live in-process swarm."""

import asyncio
import dataclasses
import functools
import threading

import pytest
import torch

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
    SwarmPipeline,
    decode,
    main,
    model_next_logits,
    sample,
    swarm_settings,
)
from tools.local import LocalConfig, sample_text
from tools.processes import LocalSwarm
from trainer.client import StageClient


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
