"""A peer that stops answering (frozen, dead, its link down) costs the stage seconds, not a timeout: the pieces.

The whole behaviour runs in tests/test_integration.py (`frozen_one`: a server SIGSTOPped for 20 s, its stall printed).
"""

import asyncio
import functools
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import grpc
import pytest

from dht.records import PeerEntry, ServerRecord
from server.collab import AdmissionRefused
from server.collab.gate import ADMISSION_REPLY_MARGIN_S
from server.collab.progress import StagePeers
from server.stage_server import MAX_ANNOUNCES_IN_FLIGHT, PeerState, StageServer
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, StageStub, aio_channel
from swarm.vetting import Vetting
from tests.peers import stage_servers, start_server, wait_for_async
from tests.stages import hanging_stage_server
from tests.unit.test_hung_peers import ListingDHT
from trainer.routing import StageRouter
from trainer.trainer import MAX_LOOKUPS_IN_FLIGHT, Trainer


@pytest.mark.timeout(30)
async def test_a_progress_in_flight_when_another_drops_the_frozen_peer_fails_on_its_deadline_not_cancelled():
    """Every Backward's reply waits for its Progress to the stage's peers. Two Progress messages to a frozen peer,
    0.5 s apart: the first times out and drops the peer, and with it the channel. The second, still in flight on that
    channel, used to end in CancelledError (grpc.aio cancels a closed channel's calls), which ended the waiting
    Backward's handler without a status: its trainer heard nothing until its own deadline (10 s of a soak's stall).
    Now the second ends on its own deadline as a message the peer did not take."""
    async with hanging_stage_server() as (address, _):
        peers = StagePeers(ListingDHT({"frozen": address}), stage=1, peer_timeout=1.0)
        await peers.refresh()
        peers.record(pb.StageProgress(peer_id="frozen", epoch=0, samples=4))  # it spoke once, then froze
        first = asyncio.ensure_future(peers.broadcast(0, 4, False))
        await asyncio.sleep(0.5)
        started = time.monotonic()
        second = await peers.broadcast(0, 8, False)
        assert second == {} and await first == {}
        assert 0.3 < time.monotonic() - started < 2.0
        assert peers.held == {"frozen": address}
        await peers.close()


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_forward_whose_admission_waits_on_a_frozen_stage_peer_is_answered_before_its_deadline():
    """A stage-0 peer claims its share of the global batch from every stage peer before it admits (and meets them
    before its first admission). A frozen one holds that Progress for --peer-timeout: the Forward must be answered
    ("ask again": no ban, retried at once) before its caller's deadline rather than hang past it, which the trainer
    takes for a dead peer (a ban, and a doubled deadline for the stage's every call)."""
    async with hanging_stage_server() as (address, frozen), stage_servers() as (initial_peers, servers):
        servers.append(a := await start_server(initial_peers, stage=0))
        a.collab.peers.peers["frozen"] = address  # listed, never heard from: it must be claimed
        started = time.monotonic()
        with pytest.raises(AdmissionRefused, match="ask again"):
            await a.collab.admit("mb-1", 2, deadline=started + ADMISSION_REPLY_MARGIN_S + 0.5)
        assert time.monotonic() - started < 1.5 and frozen.is_set()
        await wait_for_async(lambda: "frozen" not in a.collab.peers.peers, 10, "the frozen peer to be dropped")
        ticket = await a.collab.admit("mb-1", 2, deadline=time.monotonic() + 10)
        assert ticket.global_batch == a.collab.epoch


FROZEN_SERVER = """
import asyncio
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import stage_handler, start_stage_server

async def main():
    async def slow(request, context):
        await asyncio.sleep(3600)

    server, _, port = await start_stage_server(stage_handler(slow, slow, slow, slow), "127.0.0.1", 0)
    print(port, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_call_to_a_frozen_process_fails_within_the_keepalive_not_its_deadline():
    """A peer SIGSTOPped with a call open (a hung host) answers no HTTP/2 ping: the channel must close and fail the
    call within KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS, not wait out its deadline. gRPC 1.85 bounds a ping's wait
    by `grpc.http2.ping_timeout_ms` (default 60 s), not by `grpc.keepalive_timeout_ms`: without it, this call
    waited its whole 30 s."""
    server = subprocess.Popen(
        [sys.executable, "-c", FROZEN_SERVER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        port = int(server.stdout.readline())
        async with aio_channel(f"127.0.0.1:{port}") as channel:
            call = asyncio.ensure_future(StageStub(channel).info(pb.InfoRequest(), timeout=30))
            await asyncio.sleep(0.5)  # the call is open on the server
            os.kill(server.pid, signal.SIGSTOP)
            frozen = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await call
            took = time.monotonic() - frozen
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
        assert took < (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000 + 3, took
    finally:
        os.killpg(server.pid, signal.SIGKILL)  # a stopped process dies of SIGKILL too
        server.wait(10)


class SlowDHT:
    """A DHT whose every store and lookup takes `delay` seconds, as while a peer's DHT node is frozen (6-9 s each in
    the kill/freeze soak). Records what each store carried and when each call began."""

    def __init__(self, delay: float):
        self.delay, self.stored, self.looked_up = delay, [], []
        self.in_flight = self.most_in_flight = 0

    async def _wait(self) -> None:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.in_flight -= 1

    async def announce(self, record: ServerRecord, ttl: float) -> bool:
        self.stored.append(record.port)
        await self._wait()
        return True

    async def lookup(self, stage: int) -> list[PeerEntry]:
        self.looked_up.append(stage)
        await self._wait()
        return [PeerEntry("a", ServerRecord(host="127.0.0.1", port=1, stage=stage), time.time() + 20)]


@pytest.mark.timeout(30)
async def test_announces_and_lookups_that_a_frozen_dht_node_holds_do_not_hold_the_next_ones():
    """A server announces every period and a trainer looks every stage up every period, whether the last ones came back
    or not (a few at most in flight): one after the other, stores and lookups that each waited for a frozen peer's
    DHT node left gaps longer than a record's lifetime, and trainers found healthy stages empty."""
    dht, period = SlowDHT(delay=0.5), 0.1  # 5 periods per store or lookup
    ports = iter(range(1000, 2000))
    server = SimpleNamespace(
        state=PeerState.SERVING,
        destination=None,
        cfg=SimpleNamespace(network=SimpleNamespace(announce_period=period, record_ttl=12.0)),
        sdht=dht,
        take_snapshot=lambda: None,
        record=lambda ready=True, stage=None: ServerRecord(host="127.0.0.1", port=next(ports), stage=1),
        _log_status=lambda: None,
    )
    server._store = functools.partial(StageServer._store, server)
    stop = asyncio.Event()
    announcing = asyncio.create_task(StageServer.announce_forever(server, stop, rebalancing=True))  # type: ignore[arg-type]
    await asyncio.sleep(1.25)
    stop.set()
    await announcing
    assert dht.most_in_flight == MAX_ANNOUNCES_IN_FLIGHT, "stores waited for each other, or too many ran"
    assert len(dht.stored) > 3 and dht.stored == sorted(dht.stored)  # each read its record when it began
    assert dht.in_flight == 0, "stores left running when the server stopped"

    trainer = SimpleNamespace(
        n_stages=2,
        sdht=dht,
        cfg=SimpleNamespace(discovery_period=period),
        records=[{}, {}],
        routers=[StageRouter(), StageRouter()],
        peers_changed=asyncio.Event(),
        vetting=[Vetting(), Vetting()],
        _listed=[{}, {}],
    )
    trainer._route = functools.partial(Trainer._route, trainer)
    vetted: list[asyncio.Task] = []

    async def vet(stage: int, peer_id: str, address: str) -> None:  # every listed peer answers as itself
        trainer.vetting[stage].answered(peer_id, address, True)
        trainer._route(stage)

    trainer._vet, trainer._background = vet, lambda coroutine: vetted.append(asyncio.ensure_future(coroutine))
    dht.most_in_flight = 0
    discovering = asyncio.create_task(Trainer._discover_forever(trainer))  # type: ignore[arg-type]
    await asyncio.sleep(1.25)
    discovering.cancel()
    await asyncio.gather(discovering, return_exceptions=True)
    assert dht.most_in_flight == 2 * MAX_LOOKUPS_IN_FLIGHT, "lookups waited for each other, or too many ran"
    assert dht.in_flight == 0, "lookups left running when discovery stopped"
    for stage in range(2):
        assert dht.looked_up.count(stage) > 3
        assert trainer.routers[stage].available == ["a"] and trainer.records[stage]["a"].stage == stage
