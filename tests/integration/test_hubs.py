"""A stage of four real peers (in this process: tests/peers.py) shares per-backward counts through its epoch's hubs
(server/collab/hubs.py): a count reaches every peer in two calls of its sender, through either hub when the other
withholds, and what a hub passes on counts only as far as its own sender's signature and the usual checks go."""

import asyncio

import grpc
import pytest

from dht.identity import Identity
from server.collab import hubs
from server.collab.hubs import hubs_for
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import StageStub, aio_channel
from tests.peers import meet, stage_servers, start_server, wait_for_async
from tests.unit.test_identity import signed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]


def envelope(identity: Identity, epoch: int, passed_on: list[pb.StageProgress]) -> pb.StageProgress:
    return signed(identity, peer_id=identity.peer_id, epoch=epoch, passed_on=passed_on)


async def test_counts_go_through_the_hubs_and_a_hub_can_only_withhold(monkeypatch):
    monkeypatch.setattr(hubs, "HUB_FROM", 3)  # four peers use hubs as a stage of eight would
    async with stage_servers() as (initial_peers, servers):
        for _ in range(4):
            servers.append(await start_server(initial_peers))
        await meet(*servers)
        by_id = {s.sdht.peer_id: s for s in servers}
        epoch = servers[0].collab.epoch
        hub_ids = hubs_for(epoch, by_id)
        sender = next(s for s in servers if s.sdht.peer_id not in hub_ids)
        others = [s for s in servers if s is not sender]

        def count_of(server, peer) -> tuple[int, int] | None:
            return server.collab.peers.view.get(peer.sdht.peer_id)

        # a count of the sender's work: to the two hubs alone, and from them to everybody
        answered = await sender.collab.peers.broadcast(epoch, 3, False, via_hubs=True)
        assert sorted(answered) == sorted(hub_ids)
        await wait_for_async(lambda: all(count_of(o, sender) == (epoch, 3) for o in others), 10, "the count")

        # one hub withholds everything: the other passes the next count on
        withholding = by_id[hub_ids[0]]
        withholding.collab.peers.hub.add = lambda msg, urgent=False: None
        await sender.collab.peers.broadcast(epoch, 5, False, via_hubs=True)
        await wait_for_async(lambda: all(count_of(o, sender) == (epoch, 5) for o in others), 10, "the count")

        # what a hub may pass on: forgeries of every kind, and what changes nothing
        hub, receiver = by_id[hub_ids[1]], next(o for o in others if o.sdht.peer_id not in hub_ids)
        old = signed(sender.sdht.identity, peer_id=sender.sdht.peer_id, epoch=epoch, samples=1)
        tampered = signed(sender.sdht.identity, peer_id=sender.sdht.peer_id, epoch=epoch, samples=4)
        tampered.samples = 40
        impossible = signed(sender.sdht.identity, peer_id=sender.sdht.peer_id, epoch=epoch, samples=10**6)
        stranger = Identity()
        strangers = signed(stranger, peer_id=stranger.peer_id, epoch=epoch, samples=2)
        nested = envelope(hub.sdht.identity, epoch, [old])
        async with aio_channel(receiver.record().address) as channel:
            # a replay, an altered count, an impossible one and a stranger's: the hub's own part counts, none of these
            ack = await StageStub(channel).progress(
                envelope(hub.sdht.identity, epoch, [old, tampered, impossible, strangers]), timeout=10
            )
            assert ack.epoch == receiver.collab.epoch
            assert count_of(receiver, sender) == (epoch, 5)
            assert receiver.collab.peers.seen(old) and not receiver.collab.peers.seen(tampered)
            assert not receiver.collab.peers.seen(impossible) and not receiver.collab.peers.seen(strangers)
            assert stranger.peer_id not in receiver.collab.peers.view
            refusals = {
                "passed on by a stranger": envelope(
                    stranger, epoch, [signed(sender.sdht.identity, peer_id=sender.sdht.peer_id, epoch=epoch, samples=7)]
                ),
                "passed on twice over": envelope(hub.sdht.identity, epoch, [nested]),
                "more than a call may carry": envelope(hub.sdht.identity, epoch, [old] * 257),
                "an envelope altered after signing": envelope(hub.sdht.identity, epoch, []),
            }
            refusals["an envelope altered after signing"].passed_on.append(tampered)
            for what, msg in refusals.items():
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await StageStub(channel).progress(msg, timeout=10)
                assert info.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT), what
            await asyncio.sleep(0.5)
            assert count_of(receiver, sender) == (epoch, 5), "nothing refused counted"
