"""An open swarm's strangers: peers with valid keys of their own that announce themselves and sign what they like.
Each test is one hole a stranger found, closed: what it tries changes no state of the honest peers."""

import asyncio

import pytest

from dht.node import SwarmDHT
from dht.records import ServerRecord
from swarm.compression import CompressionPolicy
from swarm.protocol.tensors import WireStats
from tests.integration.test_tickets import admitted, last_stage_backward
from tests.peers import SWARM, stage_servers, start_server
from tests.stages import raw_call
from tests.unit.test_tickets import meta_of, signed_by
from trainer.client import StageClient

pytestmark = pytest.mark.timeout(120)


async def test_a_strangers_admission_far_ahead_moves_no_stage():
    """A stranger announces a signed stage-0 record (what any volunteer does), signs an admission 1000 epochs ahead
    and sends stage 1 a Backward carrying it: the call is served (the stranger's microbatch is as good as anyone's),
    and stage 1 stays at stage 0's epoch. Before, stage 1 jumped 1000 epochs, and the real admissions never ended an
    epoch after that."""
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
            epoch = last.service.worker.epoch
            lie = signed_by(stranger.identity, "mb-lie", epoch, epoch + 1000)
            await raw_call(last.record().address, "Backward", last_stage_backward(meta_of(lie, "mb-lie")))
            assert last.service.worker.epoch == epoch, "the stranger's word moved the stage"
            assert stranger.peer_id in last.collab.tickets.signers, "it was listed, and its admission verified"
        finally:
            await client.close()
            stranger.shutdown()
