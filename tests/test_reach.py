"""Reachability checks over libp2p (swarm/protocol/reach.py): real DHT nodes, a real gRPC Stage service to dial."""

import asyncio
import functools
import logging
from types import SimpleNamespace

import pytest

from dht.node import SwarmDHT, start_dht
from server import reachability, stage_server
from server.reachability import helper_ids
from server.stage_server import StageServer
from swarm.net import is_own_address, join_host_port, listen_multiaddrs
from swarm.protocol import reach
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.reach import HANDLER, ReachResponder, check_reachability, is_local, valid_host
from swarm.protocol.rpc import StageStub, aio_channel, stage_handler, start_stage_server
from tests.conftest import free_port
from tests.peers import stage_servers, start_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


async def info_server(p2p_id: str):
    """A Stage service whose Info names `p2p_id` (Forward and Backward are never called here)."""

    async def info(request, context):
        return pb.InfoReply(p2p_id=p2p_id)

    async def refuse(request, context):
        raise NotImplementedError

    server, _, port = await start_stage_server(stage_handler(refuse, refuse, info, refuse), "127.0.0.1", 0)
    return server, port


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


def test_helpers_come_from_bootstrap_multiaddrs_and_server_records_never_ourselves():
    boot = "12D3KooWQBv7jYsoiBwtMEDheLC67AMsVz8ACyUyNkCeSgHDt1o1"  # a real libp2p id
    ids = helper_ids(
        [f"/ip4/10.0.0.1/tcp/31337/p2p/{boot}", "/ip4/10.0.0.2/tcp/1", "garbage"],
        ["me", "not-a-peer-id", ""],
        "me",
        k=5,
    )
    assert [i.to_base58() for i in ids] == [boot]


def test_hosts_a_responder_dials_are_names_or_addresses_and_its_loopback_only_for_local_askers():
    for good in ("example.org", "node-1.swarm.example.", "10.0.0.1", "2001:db8::1", "[::1]"):
        assert valid_host(good), good
    for bad in ("unix:/tmp/x", "ipv4:1.2.3.4", "dns:///x", "a..b", "-a.b", "x y", "h" * 254, "a" * 64 + ".org", ""):
        assert not valid_host(bad), bad
    for local in ("127.0.0.1", "127.8.0.1", "::1", "localhost", "169.254.1.1", "fe80::1"):
        assert is_local(local), local
    for remote in ("10.0.0.1", "203.0.113.7", "example.org", "2001:db8::1"):
        assert not is_local(remote), remote


def test_an_address_the_swarm_sees_us_at_is_ours_only_if_an_interface_holds_it():
    """Behind NAT the swarm sees us at the router's address: not ours, so the server waits for a relay slot."""
    assert is_own_address("127.0.0.1") and is_own_address("[::1]")
    for other in ("192.0.2.1", "2001:db8::1", "example.org", ""):
        assert not is_own_address(other), other


async def test_a_server_behind_nat_waits_for_a_relay_slot_and_no_longer_than_its_bound(monkeypatch, caplog):
    """StageServer._wait_for_relay_slot against a stand-in for its daemon: done at the poll that first lists a
    /p2p-circuit address (a daemon with no address yet raises, as hivemind's does); with none ever, it gives up at
    RELAY_SLOT_WAIT_S and says so."""
    monkeypatch.setattr(stage_server, "RELAY_SLOT_POLL_S", 0.01)
    monkeypatch.setattr(stage_server, "RELAY_SLOT_WAIT_S", 0.5)
    relay = "/ip4/11.0.0.1/tcp/5/p2p/QmRelay/p2p-circuit/p2p/QmUs"
    answers: list = [ValueError("No multiaddrs found"), ["/ip4/192.168.7.2/tcp/5/p2p/QmUs"], [relay]]
    polls = 0

    async def get_visible_maddrs(latest: bool = False) -> list[str]:
        nonlocal polls
        polls += 1
        assert latest, "a slot is asked of the daemon, not of its cached addresses"
        answer = answers[min(polls, len(answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def p2p():
        return SimpleNamespace(get_visible_maddrs=get_visible_maddrs)

    server = object.__new__(StageServer)  # its daemon only
    server.sdht = SimpleNamespace(p2p=p2p)
    with caplog.at_level(logging.INFO, logger="swarm.server"):
        await server._wait_for_relay_slot()
    assert polls == 3 and "a relay holds a slot for us after" in caplog.text and relay in caplog.text

    answers[:] = [["/ip4/192.168.7.2/tcp/5/p2p/QmUs"]]
    started = asyncio.get_running_loop().time()
    await server._wait_for_relay_slot()
    assert 0.5 <= asyncio.get_running_loop().time() - started < 1.5
    assert "no relay holds a slot for us after" in caplog.text


def test_dual_stack_listens_on_both_families_and_ipv6_addresses_are_bracketed():
    assert listen_multiaddrs("::", 0) == ["/ip4/0.0.0.0/tcp/0", "/ip6/::/tcp/0"]
    assert listen_multiaddrs("127.0.0.1", 5) == ["/ip4/127.0.0.1/tcp/5"]
    assert listen_multiaddrs("::1", 5) == ["/ip6/::1/tcp/5"]
    assert join_host_port("::1", 7000) == "[::1]:7000" and join_host_port("10.0.0.1", 7000) == "10.0.0.1:7000"


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


def test_a_report_that_nobody_could_check_says_why_in_printable_words():
    result = reach.Reachability(asked=2, reachable=[], unreachable=[], declined=["busy: ask again in 10s", "x"])
    report = reachability.SelfTest(result, None).report(7000, "--x")
    assert report.endswith("none of 2 peers asked could check: busy: ask again in 10s; x")
    assert reach.printable("a\x1b[31mb\nc") == "a\ufffd[31mb\ufffdc"


def test_only_a_decline_that_may_pass_is_worth_asking_again():
    def declined(*why):
        return reach.Reachability(asked=len(why), reachable=[], unreachable=[], declined=list(why))

    assert declined("busy: ask again in 10s").worth_asking_again
    assert declined("x1y2z3 could not be asked (P2PHandlerError)", "x1y2z3 did not answer in time").worth_asking_again
    assert declined("no direct connection to the asker (relayed?)").worth_asking_again
    assert not declined("x1y2z3 could not be asked (P2PHandlerError)").worth_asking_again  # a node without the handler
    assert not declined("refused: this swarm is private and the request did not prove its key").worth_asking_again
    assert not declined().worth_asking_again  # nobody to ask
    unreachable = reach.Reachability(asked=2, reachable=[], unreachable=[("1.2.3.4:5", "no")], declined=["busy"])
    assert not unreachable.worth_asking_again  # one answered


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
