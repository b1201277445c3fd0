"""TLS on the Stage service with certificates pinned by signed DHT records (swarm/protocol/tls.py): real servers,
real DHT, real handshakes."""

import logging

import grpc
import pytest

from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import Channels, StageStub, aio_channel
from swarm.protocol.tls import PINS, TlsConfig, cert_fingerprint, self_signed
from tests.peers import meet, stage_servers, start_server, wait_for_async

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


async def info(channel: grpc.aio.Channel) -> pb.InfoReply:
    return await StageStub(channel).info(pb.InfoRequest(), timeout=5)


async def test_tls_peers_pin_each_others_certificates_and_refuse_anything_else(caplog):
    caplog.set_level(logging.INFO, logger="swarm.server")
    async with stage_servers() as (peers, servers):
        servers.append(await start_server(peers, tls=TlsConfig(tls_self_signed=True)))
        servers.append(await start_server(peers, tls=TlsConfig(tls_self_signed=True)))
        a, b = servers
        # stage peers found each other and exchange Progress over TLS, pinned from each other's records
        await meet(a, b)
        await a.collab.after_backward()  # a Progress to b
        await wait_for_async(lambda: b.collab.peers.heard_from(a.sdht.peer_id), 10, "b to hear a's Progress")
        lines = [r.getMessage() for r in caplog.records if r.name == "swarm.server"]
        assert any(
            f"reachable: 1 of 2 swarm peers asked dialled our Stage service at {b.record().address}" in line
            for line in lines
        ), lines

        address = a.record().address
        entries = {e.peer_id: e for e in await b.sdht.discover(0)}
        assert cert_fingerprint(entries[a.sdht.peer_id].record.tls_cert) == a.tls.fingerprint
        assert PINS[address] == a.tls.cert_pem

        channels = Channels()  # what trainers, stage peers and the monitor use: trusts the pinned certificate
        try:
            reply = await channels.stub(address).info(pb.InfoRequest(), timeout=5)
            assert reply.p2p_id == a.sdht.p2p_id and reply.transport == "grpc+tls"
        finally:
            await channels.close()

        for cert in ("", self_signed().cert_pem, b.tls.cert_pem):  # plaintext; a stranger's; another peer's
            async with aio_channel(address, cert) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await info(channel)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
