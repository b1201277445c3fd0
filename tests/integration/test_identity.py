"""Identity for everything that changes a stage's state: DHT records only their key's owner can write, and Progress
messages that count only when signed by a peer the DHT lists on the stage. Real in-process stage peers (tests/peers.py)
and, as the attacker, a stock `hivemind.DHT` that runs no validator and signs nothing."""

import asyncio

import grpc
import pytest
from hivemind.utils import get_dht_time

from dht.identity import Identity, fingerprint
from dht.node import SwarmDHT, start_dht
from dht.records import ServerRecord, settings, stage_key
from server.collab.tickets import ticket_bytes
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import PROTOCOL_VERSION, StageStub, aio_channel
from swarm.rebalance import Move, RebalanceConfig, decide
from tests.peers import SWARM, meet, stage_servers, start_server, stock_dht
from tests.unit.test_identity import signed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


async def test_forged_records_are_never_listed_and_forged_progress_changes_nothing():
    async with stage_servers() as (initial_peers, servers):
        for _ in range(2):
            servers.append(await start_server(initial_peers))
        a, b = servers
        await meet(a, b)
        real = {e.peer_id: e.record for e in await a.sdht.discover(0)}
        assert set(real) == {a.sdht.peer_id, b.sdht.peer_id}

        # the attacker: a stock hivemind DHT node in the swarm, no validator, signing nothing
        attacker = await asyncio.get_running_loop().run_in_executor(
            None, lambda: stock_dht(initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        )
        try:
            key = stage_key(SWARM, 0)
            fake = ServerRecord(host="127.0.0.1", port=1, stage=0, throughput=1000.0).to_dict()
            stores = [
                ("an unprotected subkey claiming 1000 samples/s", "fake-server"),
                ("b's peer id as a plain subkey", b.sdht.peer_id),
                ("b's owner subkey, unsigned: overwrite b", b.sdht.identity.owner_subkey),
                ("a fresh key's owner subkey, unsigned", Identity().owner_subkey),
            ]
            for _what, subkey in stores:
                await asyncio.get_running_loop().run_in_executor(
                    None, lambda s=subkey: attacker.store(key, fake, get_dht_time() + 60, subkey=s)
                )
            for _ in range(3):  # the nodes that keep the key refused the writes; readers skip what is not owned
                listed = {e.peer_id: e.record for e in await a.sdht.discover(0, include_pending=True)}
                assert listed.keys() == real.keys(), listed
                assert listed[b.sdht.peer_id].address == real[b.sdht.peer_id].address
                assert all(r.port != 1 for r in listed.values()), listed
                await asyncio.sleep(0.5)
        finally:
            attacker.shutdown()

        # forged Progress, straight to a's Stage service
        epoch, version = a.collab.epoch, a.worker.param_version
        view = dict(a.collab.peers.view)
        stranger = Identity()
        forged = {
            "made-up peer id, unsigned": pb.StageProgress(
                protocol_version=PROTOCOL_VERSION,
                stage=0,
                peer_id="made-up",
                epoch=10**6,
                samples=10**9,
                end_epoch=True,
            ),
            "a stranger's valid signature": signed(
                stranger, peer_id=stranger.peer_id, epoch=epoch, samples=8, end_epoch=True
            ),
            "b's id with a stranger's key": signed(
                stranger, peer_id=b.sdht.peer_id, epoch=epoch, samples=8, end_epoch=True
            ),
        }
        tampered = signed(b.sdht.identity, peer_id=b.sdht.peer_id, epoch=epoch, samples=1)
        tampered.samples, tampered.end_epoch = 8, True  # changed after signing
        forged["b's message, altered after signing"] = tampered
        garbage_key = bytes(range(256)) * 2
        forged["a garbage key with its own fingerprint, a garbage signature"] = pb.StageProgress(
            protocol_version=PROTOCOL_VERSION,
            stage=0,
            peer_id=fingerprint(garbage_key),
            epoch=epoch,
            samples=8,
            public_key=garbage_key,
            signature=b"\xff" * 256,
        )
        oversized = signed(b.sdht.identity, peer_id=b.sdht.peer_id, epoch=epoch, samples=1)
        oversized.signature = oversized.signature * 20  # past what the service reads
        forged["b's message with a 7 kB signature"] = oversized
        forged["b's signed message with an impossible count"] = signed(
            b.sdht.identity, peer_id=b.sdht.peer_id, epoch=epoch, samples=10**6, end_epoch=True
        )
        forged["a stranger's signed claim of a share, with a lineage"] = signed(
            stranger, peer_id=stranger.peer_id, epoch=epoch, claims=True, lineage="f" * 16
        )
        forged["b's claim and lineage, signed with a stranger's key"] = signed(
            stranger, peer_id=b.sdht.peer_id, epoch=epoch + 1, claims=True, lineage="f" * 16
        )
        forged["b's signed message with a malformed lineage"] = signed(
            b.sdht.identity, peer_id=b.sdht.peer_id, epoch=epoch + 1, lineage="x" * 40
        )
        stepped = signed(b.sdht.identity, peer_id=b.sdht.peer_id, epoch=epoch + 1)
        stepped.averaged = epoch  # "my round of this epoch ended", added after signing
        forged["b's message, a round's end added after signing"] = stepped
        forged["a stranger's signed end of a round"] = signed(
            stranger, peer_id=stranger.peer_id, epoch=epoch + 1, averaged=epoch
        )
        forged["b's signed end of a round it has not reached"] = signed(
            b.sdht.identity, peer_id=b.sdht.peer_id, epoch=epoch, averaged=epoch + 5
        )
        claims = dict(a.collab.peers._claims)
        async with aio_channel(a.record().address) as channel:
            for what, msg in forged.items():
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await StageStub(channel).progress(msg, timeout=5)
                assert info.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT), (
                    what,
                    info.value,
                )
            await asyncio.sleep(1.0)
            assert (a.collab.epoch, a.worker.param_version) == (epoch, version)
            assert set(a.collab.peers.view) <= set(view) | {b.sdht.peer_id}
            assert a.collab.peers.view.get(b.sdht.peer_id, (epoch, 0))[1] < 8
            assert "made-up" not in a.collab.peers.peers and stranger.peer_id not in a.collab.peers.peers
            assert a.collab.peers._claims == claims, "no forged claim counts a share"
            assert all(line != "f" * 16 for _, line in a.collab.peers.lineages.values()), "nor names a lineage"
            assert not a.collab.peers.averaged, "nor ends a round for anyone"
            # b's own signed message counts
            ack = await StageStub(channel).progress(
                signed(b.sdht.identity, peer_id=b.sdht.peer_id, epoch=epoch, samples=0), timeout=5
            )
            assert ack.epoch == epoch
            # ... and the answer says how many of b's admissions a holds: b leaves those out of its next messages
            held = []
            for ids in (["m1"], ["m1"], ["m1", "m2"]):
                admissions = [
                    pb.Admission(
                        microbatch_id=m,
                        samples=4,
                        global_batch=epoch,
                        admitted_at=epoch,
                        admitted_by=b.sdht.peer_id,  # b is a stage-0 peer: its admissions are signed by its key
                        signature=b.sdht.identity.sign(ticket_bytes(m, 4, epoch, epoch)),
                    )
                    for m in ids
                ]
                msg = signed(b.sdht.identity, peer_id=b.sdht.peer_id, epoch=epoch, samples=0, served=admissions)
                held.append((await StageStub(channel).progress(msg, timeout=5)).served_held)
            assert held == [1, 1, 2]


async def test_servers_whose_settings_differ_are_not_listed_and_the_difference_is_named(caplog):
    loop = asyncio.get_running_loop()
    boot = await loop.run_in_executor(None, lambda: start_dht(swarm_name=SWARM))
    peers = [str(m) for m in boot.get_visible_maddrs()]
    ours = settings(model={"d_model": 128, "n_stages": 3}, optimizer={"lr": 2e-3})
    theirs = settings(model={"d_model": 64, "n_stages": 3}, optimizer={"lr": 2e-3})
    server, reader, trainer = [
        await loop.run_in_executor(None, lambda c=c: SwarmDHT.start(SWARM, peers, c))
        for c in (theirs, ours, settings(model={"d_model": 64, "n_stages": 3}))
    ]
    try:
        assert await server.announce(ServerRecord(host="127.0.0.1", port=7000, stage=1), ttl=30)
        with caplog.at_level("WARNING", logger="dht.node"):
            assert await reader.discover(1) == []
        assert "model.d_model: 64 (ours 128)" in caplog.text
        listed = await trainer.discover(1)  # a trainer compares the model only, and this one matches
        assert [e.peer_id for e in listed] == [server.peer_id] and listed[0].record.config == theirs
    finally:
        for node in (server, reader, trainer):
            node.shutdown()
        boot.shutdown()


async def test_signed_records_that_lie_about_their_server_never_move_a_real_peer():
    """Anyone can sign a record of their own. A forger claims 10^6 samples/s on stage 0 at an address nobody serves,
    and a starving stage 1 at a's address (a real server, which answers as a): on those records the rebalancer
    would move stage 0's only real peer to stage 1. Counting only records whose address answers Info as their owner,
    it stays."""
    async with stage_servers() as (initial_peers, servers):
        servers.append(a := await start_server(initial_peers, stage=0))
        servers.append(b := await start_server(initial_peers, stage=1))
        loop = asyncio.get_running_loop()
        forgers = [await loop.run_in_executor(None, SwarmDHT.start, SWARM, initial_peers) for _ in range(2)]
        try:
            now = get_dht_time()
            host, port = a.record().host, a.record().port
            assert await forgers[0].announce(ServerRecord(host="127.0.0.1", port=1, stage=0, throughput=1e6), 60)
            starving = ServerRecord(host=host, port=port, stage=1, throughput=0.1, demand=1000.0)
            assert await forgers[1].announce(starving, 60)
            real = {a.sdht.peer_id, b.sdht.peer_id}
            forged = {f.peer_id for f in forgers}

            def peers(view) -> set[str]:
                return {p.peer_id for s in view.stages for p in s.peers}

            as_of = get_dht_time() + 1
            raw = await a.rebalancer.view(as_of)
            assert peers(raw) == real | forged
            rb = RebalanceConfig(cooldown_s=0)
            assert decide(raw, a.sdht.peer_id, now, rb) == Move(a.sdht.peer_id, 0, 1)
            verified = await a.rebalancer.view(as_of, verified=True)
            assert peers(verified) == real
            assert decide(verified, a.sdht.peer_id, now, rb) is None
        finally:
            await a.rebalancer.close()
            for forger in forgers:
                forger.shutdown()
