"""Relays that carry stage calls (dht/relay.py): a relaying node's daemon serves the relay its flags configure (4 GiB
and 30 min per connection), not libp2p's default one (128 KiB and 2 min), and proves it at start."""

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from hivemind.p2p import P2P

from dht.node import start_dht
from dht.relay import check, report
from swarm.protocol import p2p as p2p_transport
from swarm.protocol.p2p import P2PStub, serve
from tests import holepunch_peer, netns
from tests.conftest import wait_for


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_relaying_nodes_relay_far_more_than_libp2ps_default_cap(caplog):
    """Each of 4 fresh relaying nodes carries 4 MiB each way on one relayed connection once it has started, and at
    most one of them needed a second start for it. Before the fix, 6 of 8 fresh nodes reset a connection after 128 KiB
    (4 nodes with at most one restart came 1 time in 20); after it, 8 of 8 passed at their first start on an idle
    machine, but one of 4 failed its first check in a loaded CI run (its daemon's scheduler can still register the
    default relay last) and was started again, as it should be."""
    caplog.set_level(logging.WARNING, logger="dht.node")
    loop = asyncio.get_running_loop()
    for _ in range(4):
        relay = await loop.run_in_executor(None, functools.partial(start_dht, relay="serve"))
        try:
            assert await check([str(m) for m in relay.get_visible_maddrs()], 4 << 20) is None
        finally:
            relay.shutdown()
    assert caplog.text.count("relay failed its check") <= 1, caplog.text
    assert "fails its check" not in caplog.text, caplog.text


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_the_check_finds_a_relay_capped_at_libp2ps_default_and_a_server_behind_it_says_so(monkeypatch, caplog):
    """A daemon whose only relay is libp2p's default one (`-relayService=false` leaves out the configured one):
    the check says the relay reset the connection, and a server that callers reach through it warns, naming the
    fix."""
    make_args = P2P._make_process_args
    monkeypatch.setattr(P2P, "_make_process_args", staticmethod(lambda *a, **k: make_args(*a, **k, relayService=0)))
    capped = await P2P.create(force_reachability="public")
    monkeypatch.setattr(P2P, "_make_process_args", staticmethod(make_args))
    try:
        maddrs = [str(m) for m in await capped.get_visible_maddrs()]
        reason = await check(maddrs)
        caplog.set_level(logging.INFO, logger="dht.relay")
        await report(maddrs * 2)  # one check per relay, whatever the number of its addresses
    finally:
        await capped.shutdown()
    assert reason is not None and "reset the connection" in reason, reason
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "give one as --initial-peers" in warnings[0], warnings


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_stage_calls_of_megabytes_go_through_a_relay():
    """A server whose DHT node accepts no connection, reached through a relaying node: 4 calls of 2 MiB each way go
    through one after another (64 times libp2p's default cap on a connection). They failed from 128 KiB before."""
    loop = asyncio.get_running_loop()
    relay = await loop.run_in_executor(None, functools.partial(start_dht, relay="serve"))
    relays = [str(m) for m in relay.get_visible_maddrs()]
    hidden = await loop.run_in_executor(None, functools.partial(start_dht, relays, relay="no-listen"))
    caller = await loop.run_in_executor(None, functools.partial(start_dht, relays, client_mode=True))
    hidden_p2p, caller_p2p = await hidden.replicate_p2p(), await caller.replicate_p2p()
    saved, p2p_transport.RELAYS[:] = list(p2p_transport.RELAYS), relays

    async def echo(frames, _context):
        async for frame in frames:
            yield frame

    async def unused(_request, _context):
        raise AssertionError("not called")

    async def get_caller_p2p():
        return caller_p2p

    try:
        await serve(hidden_p2p, echo, echo, unused, unused)
        stub = P2PStub(get_caller_p2p, str(hidden.peer_id))
        for _ in range(4):
            payload = os.urandom(2 << 20)
            frames = [payload[i : i + (1 << 20)] for i in range(0, len(payload), 1 << 20)]
            assert b"".join([frame async for frame in stub.forward(frames, timeout=60)]) == payload
        assert "through relay" in p2p_transport.path_of(
            [a for info in await caller_p2p.list_peers() if info.peer_id == hidden_p2p.peer_id for a in info.addrs]
        )
    finally:
        p2p_transport.RELAYS[:] = saved
        for p2p in (caller_p2p, hidden_p2p):
            await p2p.shutdown()
        for dht in (caller, hidden, relay):
            dht.shutdown()


@pytest.mark.integration
@pytest.mark.timeout(380)
def test_a_trainer_reaches_a_home_peer_directly_through_its_nat_once_public_peers_have_seen_it(tmp_path):
    """A real NAT (tests/netns.py): a DHT node behind a masquerading router serves the Stage service over libp2p; a
    relaying node and three more DHT nodes run on four addresses of "the internet", a trainer's node on a fifth. Once
    four peers at different addresses have seen the home node at its router's address, libp2p trusts that address,
    and the trainer's relayed dial ends in a direct connection through the NAT (hole punching, DCUtR): its 1 MiB
    calls come back whole, over `directly at /ip4/<router>/...`. With every peer at one address (as in the NAT
    test of tests/test_p2p_transport.py) or three, the calls stayed relayed for 60-90 s, so this is libp2p's rule,
    not an accident of timing. The home node dials the observers itself before the trainer starts
    (tests/holepunch_peer.py `_meet_the_observers`), and logs whom it is connected to. libp2p tries once per relayed
    connection: when the trainer dialled before the home node trusted its address (CI, once: relayed for all of
    150 s), the trainer's transport dials again once idle (swarm/protocol/p2p.py `_watch_path`; the caller here does
    it after 20 s, up to 6 times).

    CI once saw all six redials stay relayed although the home node had met the four public peers 23 s before the
    first dial, and nothing in our logs said why; it never happened in 8 runs here (4 beside two busy loops). The
    peers' logs now carry their daemons' hole-punching and AutoNAT decisions (tests/holepunch_peer.py), and a failed
    attempt is followed by one more with fresh namespaces and peers: the test fails when both fail, and a first
    failure is reported as a warning with its logs."""
    if reason := netns.unavailable():
        pytest.skip(reason)
    if (first := _punch_through(tmp_path / "first")) is None:
        return
    warnings.warn(f"the first hole-punching attempt failed; trying again with fresh peers\n{first}", stacklevel=1)
    if (second := _punch_through(tmp_path / "second")) is not None:
        pytest.fail(f"{first}\n=== second attempt\n{second}")


def _punch_through(directory: Path) -> str | None:
    """One attempt of the test above in fresh namespaces: None once a call came back whole directly through the
    NAT, else what went wrong and the tails of the peers' logs."""
    directory.mkdir()
    observers = tuple(f"11.0.0.{3 + i}" for i in range(holepunch_peer.OBSERVERS))
    trainer = f"11.0.0.{3 + len(observers)}"
    with netns.home_router() as net:
        for address in (*observers, trainer):
            net.add_wan_host(address)
        peers: dict[str, subprocess.Popen] = {}
        logs = {}

        def start(name: str, namespace: str, role: str, host: str) -> None:
            logs[name] = directory / f"{name}.log"
            peers[name] = subprocess.Popen(
                ["ip", "netns", "exec", namespace, sys.executable, "-m", "tests.holepunch_peer", role, host, directory],
                stdout=logs[name].open("w"),
                stderr=subprocess.STDOUT,
                cwd=Path(__file__).parents[2],
                start_new_session=True,
            )

        try:
            start("relay", net.wan, "relay", netns.WAN_HOST)
            for i, address in enumerate(observers):
                start(f"observer-{i}", net.wan, "observer", address)
            start("home", net.home, "home", "0.0.0.0")
            start("trainer", net.wan, "caller", trainer)
            direct = f"directly at /ip4/{netns.ROUTER_WAN}/tcp/"
            deadline = time.monotonic() + ATTEMPT_S
            while not any(
                line.get("whole") and line["path"].startswith(direct) for line in _json_lines(logs["trainer"])
            ):
                dead = [name for name, peer in peers.items() if peer.poll() is not None]
                if dead or time.monotonic() > deadline:
                    return f"no whole call {direct}... (dead: {dead})\n" + _tails(logs)
                time.sleep(1.0)
            wait_for(lambda: f"over libp2p {direct}" in logs["trainer"].read_text(), 15, "the trainer's log to say so")
            return None
        finally:
            for peer in peers.values():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(peer.pid, signal.SIGTERM)
            for peer in peers.values():
                try:
                    peer.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(peer.pid, signal.SIGKILL)
                    peer.wait()


ATTEMPT_S = 150.0  # the caller's redials (every 20 s, 6 times) end 120 s after its first dial, itself some seconds in


def _json_lines(path: Path) -> list[dict]:
    lines = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            if isinstance(parsed := json.loads(line), dict):
                lines.append(parsed)
    return lines


def _tails(logs: dict[str, Path]) -> str:
    """Each peer's log lines (the last 40), and the trainer's last 5 calls (one JSON line each)."""
    parts = []
    for name, path in logs.items():
        lines = path.read_text().splitlines()
        calls = [line for line in lines if line.startswith("{")][-5:]
        parts.append(f"--- {name}\n" + "\n".join([line for line in lines if not line.startswith("{")][-40:] + calls))
    return "\n".join(parts)
