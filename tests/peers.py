"""Real stage peers in this process: StageServers with their own DHT nodes, hivemind averagers and Progress RPCs, on a
bootstrap DHT node of their own. For tests that need peers of one stage without starting processes."""

import asyncio
import contextlib
import dataclasses
import functools
import time

import hivemind
import torch
from hivemind.utils import get_dht_time

from dht.forking import forking
from dht.node import SwarmDHT, start_dht
from server.config import (
    AveragingConfig,
    ComputeConfig,
    EpochConfig,
    NetworkConfig,
    OptimizerConfig,
    ServerConfig,
)
from server.stage_server import StageServer
from swarm.config import ModelConfig, model_config
from swarm.protocol.tls import TlsConfig

MODEL = model_config("local_debug", d_model=32, n_heads=2, d_ff=64, max_seq_len=16, n_stages=2, layers_per_stage=1)
TIMEOUT = 3.0  # --averaging-timeout
SWARM = "peertest"


async def wait_for_async(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(0.05)


async def meet(*servers: StageServer) -> None:
    """Wait (30 s at most) until every one of `servers` lists every other as a peer of its stage."""
    await wait_for_async(
        lambda: all(o.sdht.peer_id in s.collab.peers.peers for s in servers for o in servers if o is not s),
        30,
        "the stage's peers to find each other",
    )


def stock_dht(initial_peers: list[str], **kwargs) -> hivemind.DHT:
    """Blocking: a stock hivemind DHT node (no validator, no key: an outsider's), forked with the collector frozen as
    ours are (dht/forking.py) and waited for 30 s at most: a child forked without that can hang in a gRPC finalizer,
    and hivemind's own `start=True` waits for it for ever."""
    with forking():
        node = hivemind.DHT(initial_peers=initial_peers, start=False, **kwargs)
        node.run_in_background(await_ready=False)
    node.wait_until_ready(30)
    return node


async def hide_from_state_sharing(server: StageServer) -> None:
    """Make the DHT record of who shares state say that `server` does not, for the rest of the test. That record can
    lag behind the peers' real state by tens of seconds: copying must not depend on it."""
    key = f"{server.collab.averaging.state.prefix}.all_averagers"
    store = functools.partial(
        server.sdht.dht.store, key, None, get_dht_time() + 120, subkey=server.sdht.dht.peer_id.to_bytes()
    )
    assert await asyncio.get_running_loop().run_in_executor(None, store)


async def start_server(
    initial_peers: list[str],
    network: dict | None = None,
    tls: TlsConfig | None = None,
    stage: int = 0,
    model: ModelConfig = MODEL,
    epochs: dict | None = None,
    **averaging,
) -> StageServer:
    """A peer of `stage` of `model`; `network`, `epochs`, `averaging`: NetworkConfig, EpochConfig and AveragingConfig
    fields other than the tests' defaults."""
    loop = asyncio.get_running_loop()
    sdht = await loop.run_in_executor(None, SwarmDHT.start, SWARM, initial_peers)
    cfg = server_config(initial_peers, **averaging)
    cfg = dataclasses.replace(
        cfg,
        network=dataclasses.replace(cfg.network, **(network or {})),
        epochs=dataclasses.replace(cfg.epochs, **(epochs or {})),
        tls=tls or TlsConfig(),
    )
    server = StageServer(cfg, model, sdht, torch.device("cpu"))
    await server.enter(stage)
    return server


@contextlib.asynccontextmanager
async def stage_servers():
    """Yields (initial peers, a list to append started servers to); stops them all and the bootstrap DHT."""
    boot = await asyncio.get_running_loop().run_in_executor(None, functools.partial(start_dht, swarm_name=SWARM))
    servers: list[StageServer] = []
    try:
        yield [str(m) for m in boot.get_visible_maddrs()], servers
    finally:
        for server in reversed(servers):
            await server.shutdown()
            server.sdht.dht.shutdown()
        boot.shutdown()


def server_config(initial_peers: list[str], **averaging) -> ServerConfig:
    return ServerConfig(
        stage="0",
        network=NetworkConfig(initial_peers=initial_peers, announce_period=1.0),
        optimizer=OptimizerConfig(clip_grad_norm=0.0),
        compute=ComputeConfig(torch_threads=1),
        epochs=EpochConfig(samples_per_step=8, progress_period=0.1),
        averaging=AveragingConfig(**{"matchmaking_time": 0.5, "averaging_timeout": TIMEOUT, **averaging}),
        rebalance=False,
    )
