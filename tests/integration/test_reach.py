"""Reachability checks over libp2p (swarm/protocol/reach.py): real DHT nodes, a real gRPC Stage service to dial."""

import asyncio
import functools
import logging

import pytest

from dht.node import SwarmDHT, start_dht
from server import reachability
from swarm.protocol import reach
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.reach import HANDLER, ReachResponder, check_reachability
from swarm.protocol.rpc import StageStub, aio_channel, stage_handler, start_stage_server
from tests.conftest import free_port
from tests.peers import stage_servers, start_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
async def nodes(monkeypatch):
    """(helper's P2P, asker's P2P, asker's libp2p id): two DHT nodes; the helper answers reach checks, with no rate
    limit unless a test sets one."""
    monkeypatch.setattr(reach, "MIN_INTERVAL_S", 0.0)
    loop = asyncio.get_running_loop()
    helper = await loop.run_in_executor(None, start_dht)
    asker = await loop.run_in_executor(
        None, functools.partial(start_dht, [str(m) for m in helper.get_visible_maddrs()])
    )
    try:
        helper_p2p, asker_p2p = await helper.replicate_p2p(), await asker.replicate_p2p()
        await ReachResponder(helper_p2p).start()
        yield helper_p2p, asker_p2p, str(asker.peer_id)
    finally:
        asker.shutdown()
        helper.shutdown()


async def info_server(p2p_id: str):
    """A Stage service whose Info names `p2p_id` (Forward and Backward are never called here)."""

    async def info(request, context):
        return pb.InfoReply(p2p_id=p2p_id)

    async def refuse(request, context):
        raise NotImplementedError

    server, _, port = await start_stage_server(stage_handler(refuse, refuse, info, refuse), "127.0.0.1", 0)
    return server, port


async def test_a_helper_dials_back_and_confirms_only_the_asker(nodes):
    helper, asker, asker_id = nodes
    ours, our_port = await info_server(asker_id)
    theirs, their_port = await info_server("12D3KooWsomebodyElse")
    try:
        result = await check_reachability(asker, [helper.peer_id], "127.0.0.1", our_port)
        assert result.ok and result.reachable == [f"127.0.0.1:{our_port}"], result

        # listening on 0.0.0.0: the helper dials the address it sees our libp2p connection come from
        result = await check_reachability(asker, [helper.peer_id], "0.0.0.0", our_port)
        assert result.reachable == [f"127.0.0.1:{our_port}"], result

        # another server at that address: not a confirmation of ours
        result = await check_reachability(asker, [helper.peer_id], "127.0.0.1", their_port)
        assert not result.ok and "not the one asking" in result.unreachable[0][1], result

        # nothing listens there
        result = await check_reachability(asker, [helper.peer_id], "127.0.0.1", free_port())
        assert not result.ok and result.unreachable[0][1].startswith("unavailable"), result
    finally:
        await ours.stop(None)
        await theirs.stop(None)


@pytest.mark.parametrize(
    "request_",
    [
        pb.ReachRequest(host="127.0.0.1", port=0),
        pb.ReachRequest(host="127.0.0.1", port=70000),
        pb.ReachRequest(host="127.0.0.1", port=-1),
        pb.ReachRequest(host="h" * 10_000, port=5000),
        pb.ReachRequest(host="unix:/tmp/some.sock", port=5000),
        pb.ReachRequest(host="ipv4:127.0.0.1", port=5000),
        pb.ReachRequest(host="a..b", port=5000),
        pb.ReachRequest(host="127.0.0.1", port=5000, tls_cert="-----BEGIN CERTIFICATE-----\ngarbage"),
    ],
    ids=["port-0", "port-70000", "port-negative", "huge-host", "unix-target", "grpc-scheme", "empty-label", "bad-cert"],
)
async def test_malformed_requests_get_a_short_refusal_and_no_dial(nodes, request_):
    helper, asker, _ = nodes
    reply = await asker.call_protobuf_handler(helper.peer_id, HANDLER, request_, pb.ReachReply)
    assert not reply.reachable and not reply.dialled and reply.detail == "malformed request"


async def test_garbage_bytes_do_not_break_the_responder(nodes):
    helper, asker, asker_id = nodes
    _, reader, writer = await asker.call_binary_stream_handler(helper.peer_id, HANDLER)
    writer.write(b"\x00\xff" * 100)  # not a length-prefixed protobuf
    await writer.drain()
    writer.close()
    ours, port = await info_server(asker_id)
    try:  # the responder still answers the next, well-formed request
        result = await check_reachability(asker, [helper.peer_id], "127.0.0.1", port)
        assert result.ok, result
    finally:
        await ours.stop(None)


async def test_one_check_per_asker_per_interval(nodes, monkeypatch):
    helper, asker, asker_id = nodes
    monkeypatch.setattr(reach, "MIN_INTERVAL_S", 60.0)
    ours, port = await info_server(asker_id)
    try:
        first = await check_reachability(asker, [helper.peer_id], "127.0.0.1", port)
        second = await check_reachability(asker, [helper.peer_id], "127.0.0.1", port)
        assert first.ok
        assert not second.answered, "a second check within the interval must not dial"
        reply = await asker.call_protobuf_handler(helper.peer_id, HANDLER, pb.ReachRequest(port=port), pb.ReachReply)
        assert reply.detail.startswith("busy")
    finally:
        await ours.stop(None)


async def test_a_helper_without_the_handler_or_gone_counts_as_unasked(nodes):
    helper, asker, _ = nodes
    loop = asyncio.get_running_loop()
    mute = await loop.run_in_executor(
        None, functools.partial(start_dht, [str(m) for m in await helper.get_visible_maddrs()])
    )
    try:
        result = await check_reachability(asker, [mute.peer_id], "127.0.0.1", free_port())
        assert result.asked == 1 and not result.answered
    finally:
        mute.shutdown()


async def test_a_server_reports_that_the_swarm_can_reach_it(caplog):
    """A real StageServer asks its peers: the first has nobody to ask (the bootstrap node here has no responder); the
    second is dialled back by the first."""
    caplog.set_level(logging.INFO, logger="swarm.server")
    async with stage_servers() as (peers, servers):
        servers.append(await start_server(peers))
        servers.append(await start_server(peers))
        lines = [r.getMessage() for r in caplog.records if r.name == "swarm.server"]
        assert any("could not check" in line for line in lines), lines
        port = servers[1].endpoint.port
        assert any(
            f"reachable: 1 of 2 swarm peers asked dialled our Stage service at 127.0.0.1:{port}" in line
            for line in lines
        ), lines


async def test_a_server_on_ipv6_loopback_serves_and_announces_a_bracketed_address():
    async with stage_servers() as (peers, servers):
        server = await start_server(peers, network=dict(host="::1"))
        servers.append(server)
        assert server.record().address == f"[::1]:{server.endpoint.port}"
        entries = await server.sdht.discover(0)
        assert [e.record.address for e in entries] == [f"[::1]:{server.endpoint.port}"]
        async with aio_channel(server.record().address) as channel:
            assert (await StageStub(channel).info(pb.InfoRequest(), timeout=5)).p2p_id == server.sdht.p2p_id


async def test_a_self_test_that_no_helper_could_answer_asks_again(nodes, monkeypatch, caplog):
    """A helper that is busy (or slow, or not yet connected to us) the first time: the starting server asks again
    once the helper's interval has passed, rather than serving without knowing whether anyone can dial it."""
    helper, _, _ = nodes
    monkeypatch.setattr(reach, "MIN_INTERVAL_S", 1.0)
    monkeypatch.setattr(reachability, "MIN_INTERVAL_S", 1.0)
    initial_peers = [str(m) for m in await helper.get_visible_maddrs()]
    sdht = await asyncio.get_running_loop().run_in_executor(None, SwarmDHT.start, "t", initial_peers)
    ours, port = await info_server(sdht.p2p_id)
    try:
        asker = await sdht.p2p()
        assert (await check_reachability(asker, [helper.peer_id], "127.0.0.1", port)).ok  # the helper's interval starts
        with caplog.at_level(logging.INFO, logger="server.reachability"):
            test = await reachability.self_test(sdht, initial_peers, 1, "127.0.0.1", port)
        assert test.result.ok, test.result
        retried = [r.getMessage() for r in caplog.records if "asking again" in r.getMessage()]
        assert len(retried) == 1 and "busy" in retried[0], retried
        assert test.report(port, "--x").startswith("reachable: 1 of 1")
    finally:
        await ours.stop(None)
        sdht.shutdown()


async def test_a_helper_that_answers_garbage_is_bounded_and_cannot_write_escapes_into_our_log(nodes):
    """A hostile helper: a reply beyond the size bounds counts as no check (and is not asked again), and the words of
    one within them reach our log only as printable text."""
    helper, asker, _ = nodes
    loop = asyncio.get_running_loop()
    liar = await loop.run_in_executor(
        None, functools.partial(start_dht, [str(m) for m in await helper.get_visible_maddrs()])
    )
    replies = [
        pb.ReachReply(dialled="1.2.3.4:5" + "9" * 1000, detail="x"),
        pb.ReachReply(dialled="1.2.3.4:5", detail="y" * 201),
        pb.ReachReply(dialled="1.2.3.4:5\x1b[2J", detail="refused\x1b[31m\nforged line"),
    ]

    async def lie(request, context):
        return replies.pop(0)

    try:
        liar_p2p = await liar.replicate_p2p()
        await liar_p2p.add_protobuf_handler(HANDLER, lie, pb.ReachRequest)
        for _ in range(2):
            result = await check_reachability(asker, [liar.peer_id], "127.0.0.1", free_port())
            assert not result.answered and result.declined[0].endswith("answered out of bounds"), result
            assert not result.worth_asking_again
        result = await check_reachability(asker, [liar.peer_id], "127.0.0.1", free_port())
        assert result.unreachable == [("1.2.3.4:5\ufffd[2J", "refused\ufffd[31m\ufffdforged line")], result
        report = reachability.SelfTest(result, None).report(7000, "--x")
        assert all(c.isprintable() for c in report), report
    finally:
        liar.shutdown()
