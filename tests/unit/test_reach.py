"""Reachability checks over libp2p (swarm/protocol/reach.py): real DHT nodes, a real gRPC Stage service to dial."""

import asyncio
import logging
from types import SimpleNamespace

import pytest

from server import reachability, stage_server
from server.reachability import helper_ids
from server.stage_server import StageServer
from swarm.net import is_own_address, join_host_port, listen_multiaddrs
from swarm.protocol import reach
from swarm.protocol.reach import is_local, valid_host

pytestmark = pytest.mark.timeout(30)


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
