"""An open swarm's strangers: peers with valid keys of their own that announce themselves and sign what they like.
Each test is one hole a stranger found, closed: what it tries changes no state of the honest peers."""

import asyncio
import time

import grpc
import pytest
import torch

from dht.node import SwarmDHT
from dht.records import ServerRecord
from swarm.compression import CompressionPolicy, get_codec
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.frames import iter_frames
from swarm.protocol.rpc import CHANNEL_OPTIONS, PROTOCOL_VERSION, SERVICE, StageStub, aio_channel
from swarm.protocol.tensors import WireStats, encode_tensor
from tests.conftest import free_port
from tests.integration.test_tickets import admitted, last_stage_backward
from tests.peers import MODEL, SWARM, stage_servers, start_server, wait_for_async
from tests.stages import random_batch, raw_call
from tests.unit.test_identity import signed
from tests.unit.test_tickets import meta_of, signed_by
from trainer.client import StageClient
from trainer.config import TrainerConfig
from trainer.data import load_corpus, microbatches
from trainer.trainer import Trainer

pytestmark = pytest.mark.timeout(120)


async def test_a_strangers_admission_far_ahead_moves_no_stage():
    """A stranger announces a signed stage-0 record (what any volunteer does), signs an admission 1000 epochs ahead
    and sends stage 1 a Backward carrying it. Its record's address serves nothing: the call is UNAVAILABLE ("behind")
    and nothing is computed. Had it served stage 0 there (vetted), its microbatch is served as anyone's, and stage 1
    stays at stage 0's epoch. Before, stage 1 computed it and jumped 1000 epochs, and the real admissions never ended
    an epoch after that."""
    async with stage_servers() as (initial_peers, servers):
        servers.append(first := await start_server(initial_peers, stage=0))
        servers.append(last := await start_server(initial_peers, stage=1))
        loop = asyncio.get_running_loop()
        stranger = await loop.run_in_executor(None, SwarmDHT.start, SWARM, initial_peers)
        client = StageClient(CompressionPolicy(), WireStats(), max_tensor_bytes=1 << 24)
        try:
            assert await stranger.announce(ServerRecord(host="127.0.0.1", port=1, stage=0, throughput=1e6), 60)
            for i in range(3):  # real work: stage 1 computes microbatches stage 0 admitted
                ticket = await admitted(client, first, f"mb-{i}")
                await raw_call(last.record().address, "Backward", last_stage_backward(meta_of(ticket, f"mb-{i}")))
            epoch, processed = last.service.worker.epoch, last.service.worker.samples_processed
            lie = signed_by(stranger.identity, "mb-lie", epoch, epoch + 1000)
            with pytest.raises(grpc.aio.AioRpcError, match="has not answered as itself") as refused:
                await raw_call(last.record().address, "Backward", last_stage_backward(meta_of(lie, "mb-lie")))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert stranger.peer_id in last.collab.tickets.signers, "it was listed"
            assert (last.service.worker.epoch, last.service.worker.samples_processed) == (epoch, processed)
            # had its address answered as it (a stranger that serves stage 0), the frontier holds the stage
            tickets = last.collab.tickets
            tickets.vetting.listed({stranger.peer_id: tickets.addresses[stranger.peer_id]})
            tickets.vetting.answered(stranger.peer_id, tickets.addresses[stranger.peer_id], True)
            await raw_call(last.record().address, "Backward", last_stage_backward(meta_of(lie, "mb-lie")))
            assert last.service.worker.epoch == epoch, "the stranger's word moved the stage"
        finally:
            await client.close()
            stranger.shutdown()


async def told_until_taken(address: str, msg: pb.StageProgress, timeout: float = 20.0) -> None:
    """Send a Progress until the peer takes it (it refuses one from a peer it has not listed yet: its DHT read is
    throttled), or refuses it for good: the sender's record's address did not answer the peer's own Progress."""
    deadline = time.monotonic() + timeout
    async with aio_channel(address) as channel:
        while True:
            try:
                await StageStub(channel).progress(msg, timeout=10)
                return
            except grpc.aio.AioRpcError as e:
                if "did not answer" in (e.details() or ""):
                    return
                if e.code() != grpc.StatusCode.PERMISSION_DENIED or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)


async def test_a_listed_strangers_word_ends_no_epoch_of_stage_0():
    """A stranger listed on stage 0 tells stage 0's peer, in a signed Progress, to end its epoch, and reports itself
    an epoch on: nothing happens until the stranger has done work the peer could check (a round with it). Before,
    stage 0 trusted any listed peer's word and ended its epoch within a second. (A peer still in the epoch it joined
    in has no progress of its own to hold a word against, and trusts it: the peer here has trained an epoch.)"""
    async with stage_servers() as (initial_peers, servers):
        servers.append(first := await start_server(initial_peers, stage=0))
        servers.append(await start_server(initial_peers, stage=1))
        loop = asyncio.get_running_loop()
        stranger = await loop.run_in_executor(None, SwarmDHT.start, SWARM, initial_peers)
        worker = first.service.worker
        tokens = torch.randint(0, MODEL.vocab_size, (8, MODEL.max_seq_len))  # the global batch: a step alone
        await worker.submit(
            lambda: worker.backward(tokens, grad_outputs=torch.randn(8, MODEL.max_seq_len, MODEL.d_model))
        )
        await first.collab.after_backward()
        await wait_for_async(lambda: worker.epoch == 1 and not first.collab.busy, 30, "stage 0 to step alone")
        try:
            assert await stranger.announce(ServerRecord(host="127.0.0.1", port=1, stage=0, throughput=1e6), 60)
            epoch, version = worker.epoch, worker.param_version
            for told in (epoch, epoch + 1):
                msg = signed(stranger.identity, peer_id=stranger.peer_id, epoch=told, samples=8, end_epoch=True)
                await told_until_taken(first.record().address, msg)
            await asyncio.sleep(8.0)  # the poller looks every 0.1 s; a round the epoch's end began fails within 3 s
            collab = first.collab
            assert (worker.epoch, worker.param_version, collab.rounds_ok, collab.rounds_failed) == (
                epoch,
                version,
                0,
                0,
            )
        finally:
            stranger.shutdown()


async def test_a_strangers_record_at_an_address_nobody_serves_draws_no_microbatch():
    """A stranger announces a signed stage-1 record claiming 10^6 samples/s at an address nobody serves: a trainer
    probes it (and again, ever more rarely) but routes it no call; every microbatch goes through the real servers,
    none is retried, and the real stage-1 server never waits for it in a round. Before, the record drew calls as soon
    as it was listed (6 failed calls in 50 s, a quarter of the trainer's throughput), and the stage-1 server's rounds
    waited for it and failed."""
    async with stage_servers() as (initial_peers, servers):
        servers.append(await start_server(initial_peers, stage=0))
        servers.append(real := await start_server(initial_peers, stage=1))
        loop = asyncio.get_running_loop()
        stranger = await loop.run_in_executor(None, SwarmDHT.start, SWARM, initial_peers)
        sdht = await loop.run_in_executor(None, SwarmDHT.start, SWARM, initial_peers)
        data = microbatches(load_corpus(max_bytes=1 << 16), 2, MODEL.max_seq_len, seed=0)
        trainer = Trainer(TrainerConfig(max_steps=12, in_flight=2, discovery_period=0.5), MODEL, sdht, data)
        try:
            unused = free_port()  # nothing listens there: connections are refused at once
            record = ServerRecord(host="127.0.0.1", port=unused, stage=1, throughput=1e6)
            assert await stranger.announce(record, 60)
            stats = await asyncio.wait_for(trainer.run(asyncio.Event()), 90)
            assert stats["steps"] >= 12 and stats["lost_microbatches"] == 0 and stats["retries"] == 0
            routed = trainer.routers[1].snapshot()
            assert stranger.peer_id in trainer.records[1], "the stranger's record was listed"
            assert routed[real.sdht.peer_id]["chosen"] >= 12
            assert stranger.peer_id not in routed or routed[stranger.peer_id]["chosen"] == 0
            assert real.collab.rounds_failed == 0, "the stage-1 server waited for the stranger in a round"
        finally:
            stranger.shutdown()
            sdht.shutdown()


async def test_a_caller_that_takes_admissions_and_walks_away_starves_nobody():
    """A hostile caller keeps Forwards admitted at stage 0 and never sends their Backwards, beside an honest trainer.
    Its admissions run out after a few of the round trips the honest trainer shows, its share shrinks with each, and
    the honest trainer trains on with no stall of more than a few seconds. Before, the hostile caller took the global
    batch every epoch and the honest trainer waited --admission-timeout (30 s) each time."""
    async with stage_servers() as (initial_peers, servers):
        servers.append(first := await start_server(initial_peers, stage=0))
        servers.append(await start_server(initial_peers, stage=1))
        loop = asyncio.get_running_loop()
        sdht = await loop.run_in_executor(None, SwarmDHT.start, SWARM, initial_peers)
        data = microbatches(load_corpus(max_bytes=1 << 16), 2, MODEL.max_seq_len, seed=0)
        cfg = TrainerConfig(batch_size=2, max_steps=48, in_flight=2, discovery_period=0.5)
        trainer = Trainer(cfg, MODEL, sdht, data)
        # a connection of its own (channels of one process to one address share a connection by default)
        options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        hostile = grpc.aio.insecure_channel(first.record().address, options=options)
        forward = hostile.stream_stream(f"/{SERVICE}/Forward", response_deserializer=pb.Frame.FromString)
        stop = asyncio.Event()

        async def walk_away() -> int:
            taken = 0
            while not stop.is_set():
                tokens, _ = random_batch(MODEL, 2)
                meta = pb.CallMeta(protocol_version=PROTOCOL_VERSION, microbatch_id=f"hostile-{taken}", stage=0)
                request = list(iter_frames(meta, [encode_tensor("inputs", tokens, get_codec("none"))]))
                try:
                    [f async for f in forward(iter(request), timeout=10)]
                    taken += 1
                except grpc.aio.AioRpcError:  # refused: its share is taken
                    await asyncio.sleep(0.05)
            return taken

        try:
            training = asyncio.ensure_future(trainer.run(asyncio.Event()))
            await wait_for_async(lambda: trainer.steps >= 8, 60, "the honest trainer's first microbatches")
            attack = asyncio.ensure_future(walk_away())
            started, steps = time.monotonic(), trainer.steps
            longest, last, seen = 0.0, time.monotonic(), trainer.steps
            while not training.done():
                await asyncio.sleep(0.1)
                if trainer.steps != seen:
                    longest, last, seen = max(longest, time.monotonic() - last), time.monotonic(), trainer.steps
                assert time.monotonic() - started < 90, f"{trainer.steps - steps} honest microbatches in 90 s"
            stop.set()
            taken = await attack
            stats = training.result()
            assert stats["lost_microbatches"] == 0 and taken > 0
            print(
                f"\nhostile admissions {taken}; honest microbatches {trainer.steps - steps}, longest stall {longest:.2f}s"
            )
            assert longest < 8.0, f"the honest trainer stalled {longest:.1f}s"
        finally:
            stop.set()
            await hostile.close()
            sdht.shutdown()
