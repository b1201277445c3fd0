"""How a trainer's stage call treats a peer that is catching up with its stage (server/collab/epoch.py `Behind`):
not a failure of the peer. The stage's peers are tried again until --request-timeout, without a ban or a spent
attempt; before, a stage whose only live peer was catching up lost the microbatch after 8 quick tries (seen in the
kill/freeze soak). Unit level: the trainer's own retry loop, with a client that answers as such a server does."""

import asyncio
import time
import types

import grpc
import pytest
import torch

from dht.records import ServerRecord
from swarm.compression import NoneCodec
from swarm.protocol.tensors import encode_tensor
from tests.peers import MODEL
from trainer.client import StageReply
from trainer.config import TrainerConfig
from trainer.trainer import MicrobatchLost, Trainer

pytestmark = pytest.mark.timeout(60)
BEHIND = "behind: stage 1: this peer is at epoch 7, stage 0 at 9: catching up"


def trainer_with_one_peer(refusals: int, request_timeout: float) -> tuple[Trainer, list[float]]:
    """A trainer whose stage 1 has one peer, which answers UNAVAILABLE "behind: ..." `refusals` times, then serves;
    the returned list gets the time of each call."""
    cfg = TrainerConfig(request_timeout=request_timeout, min_request_timeout=min(5.0, request_timeout))
    trainer = Trainer(cfg, MODEL, types.SimpleNamespace(p2p=None), iter(()))
    trainer.records[1] = {"peer-a": ServerRecord("127.0.0.1", 1, stage=1)}
    trainer.routers[1].update_peers({"peer-a": time.time() + 3600})
    calls: list[float] = []

    async def call(*args, **kwargs) -> StageReply:
        calls.append(time.monotonic())
        if len(calls) <= refusals:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), BEHIND)
        return StageReply(encoded=None, loss=None, param_version=3)

    trainer.client.call = call  # type: ignore[method-assign]
    return trainer, calls


async def test_a_peer_catching_up_is_asked_again_without_a_ban_or_a_spent_attempt():
    trainer, calls = trainer_with_one_peer(refusals=12, request_timeout=30)  # more refusals than max_retries (8)
    try:
        reply, served_by = await trainer._call(1, "Backward", "mb-1", {"inputs": torch.zeros(2, 4)}, None)
        assert served_by == "peer-a" and reply.param_version == 3 and len(calls) == 13
        assert trainer.retries == 0 and trainer.routers[1].available == ["peer-a"]
        assert calls[-1] - calls[0] > 11 * 0.4, "a peer catching up must not be asked again at once"
    finally:
        await trainer.client.close()


async def test_a_peer_that_never_catches_up_loses_the_microbatch_at_the_request_timeout():
    trainer, calls = trainer_with_one_peer(refusals=10**6, request_timeout=2)
    try:
        started = time.monotonic()
        with pytest.raises(MicrobatchLost, match="refused Backward"):
            await trainer._call(1, "Backward", "mb-1", {"inputs": torch.zeros(2, 4)}, None)
        assert 2 <= time.monotonic() - started < 4 and len(calls) <= 6
    finally:
        await trainer.client.close()
        await asyncio.sleep(0)


async def test_a_backward_goes_to_the_peer_that_served_its_forward_while_that_peer_is_routable():
    """Local-step peers of a stage hold parameters of their own between outer rounds: a stage's Backward recomputes
    its forward on the peer that served the Forward (trainer.py `train_microbatch`). With that peer banned, another
    serves it."""
    cfg = TrainerConfig(request_timeout=10, min_request_timeout=5)
    trainer = Trainer(cfg, MODEL, types.SimpleNamespace(p2p=None), iter(()))
    peers = {
        s: {f"s{s}-{r}": ServerRecord("127.0.0.1", 1000 + 10 * s + i, stage=s) for i, r in enumerate("ab")}
        for s in range(2)
    }
    for s, records in peers.items():
        trainer.records[s] = records
        trainer.routers[s].update_peers({p: time.time() + 3600 for p in records})
    served: list[tuple[str, int, int]] = []  # (method, stage, port)
    ban_after_forward: list[bool] = []
    B, T, D = 2, MODEL.max_seq_len, MODEL.boundary_width

    async def call(address, method, stage, mb_id, tensors, expect_shape, timeout, forward_version=None, **kwargs):
        port = int(address.rpartition(":")[2])
        served.append((method, stage, port))
        if ban_after_forward and stage == 0 and method == "Forward":
            trainer.routers[0].report_failure("s0-a" if port == 1000 else "s0-b")
        out = None if stage == 0 and method == "Backward" else torch.zeros(B, T, D)
        encoded = None if out is None else encode_tensor("outputs", out, NoneCodec())
        return StageReply(encoded=encoded, loss=1.0 if stage == 1 else None, param_version=0)

    trainer.client.call = call  # type: ignore[method-assign]
    tokens = torch.zeros(B, T, dtype=torch.long)
    try:
        for i in range(6):  # the routers alternate the Forwards between the peers of stage 0
            served.clear()
            await trainer.train_microbatch(f"mb-{i}", tokens, tokens)
            forward = next(port for method, stage, port in served if stage == 0 and method == "Forward")
            backward = next(port for method, stage, port in served if stage == 0 and method == "Backward")
            assert backward == forward, served
        ban_after_forward.append(True)  # the Forward's peer is banned before its Backward
        served.clear()
        await trainer.train_microbatch("mb-banned", tokens, tokens)
        ports = [port for method, stage, port in served if stage == 0]
        assert len(ports) == 2 and ports[0] != ports[1], served
    finally:
        await trainer.client.close()
