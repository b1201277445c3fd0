"""A peer that stops answering (frozen, dead, its link down) costs the stage seconds, not a timeout: the pieces.

The whole behaviour runs in tests/test_integration.py (`frozen_one`: a server SIGSTOPped for 20 s, its stall printed).
"""

import asyncio
import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import grpc
import pytest
import torch
from hivemind.averaging.partition import AllreduceException

from dht.identity import Identity
from dht.records import PeerEntry, ServerRecord
from server.collab import AdmissionRefused
from server.collab.averaging import ParameterAveraging, round_result
from server.collab.epoch import ADMISSION_REPLY_MARGIN_S, Phase, StageCollaboration
from server.collab.hivemind_compat import AveragerClosed
from server.collab.progress import StagePeers
from server.config import AveragingConfig
from server.stage_server import MAX_ANNOUNCES_IN_FLIGHT, PeerState, StageServer
from swarm.compression import get_codec
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, StageStub, aio_channel
from tests.conftest import free_port
from tests.peers import stage_servers, start_server, wait_for_async
from tests.stages import hanging_stage_server
from trainer.routing import StageRouter
from trainer.trainer import MAX_LOOKUPS_IN_FLIGHT, Trainer


class ListingDHT:
    """What StagePeers asks the DHT: who serves the stage. Lists `addresses` (peer id -> host:port) as ready."""

    p2p = None  # no libp2p: every peer here is reached over gRPC
    identity = Identity()  # signs our Progress messages

    def __init__(self, addresses: dict[str, str]):
        self.peer_id, self.addresses = "us", addresses

    async def discover(self, stage: int, include_pending: bool = False) -> list[PeerEntry]:
        records = {p: a.rsplit(":", 1) for p, a in self.addresses.items()}
        return [
            PeerEntry(p, ServerRecord(host=h, port=int(port), stage=stage), time.time() + 20)
            for p, (h, port) in records.items()
        ]


@pytest.mark.timeout(30)
async def test_a_peer_progress_cannot_reach_stays_out_of_the_group_until_it_speaks():
    """The DHT keeps listing a frozen peer until its record expires; a DHT read must not bring it back into the group
    (a round would wait for it again), but a message from it must. A peer never heard from is not held out."""
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: the Progress fails at once (UNAVAILABLE)
    peers = StagePeers(ListingDHT({"frozen": dead}), stage=1, peer_timeout=1.0)
    await peers.refresh()
    assert peers.peers == {"frozen": dead}
    await peers._send("frozen", dead, pb.StageProgress())
    assert peers.held == {}, "a peer never heard from may still be starting: the next DHT read brings it back"
    await peers.refresh()
    peers.record(pb.StageProgress(peer_id="frozen", epoch=0, samples=4))  # it spoke once, then froze
    await peers._send("frozen", dead, pb.StageProgress())
    assert peers.peers == {} and peers.held == {"frozen": dead}
    await peers.refresh()
    assert peers.peers == {}, "a DHT read brought back a peer that does not answer"
    assert peers.unlisted(pb.StageProgress(peer_id="frozen")) is None, "it speaks again: it counts"
    assert peers.peers == {"frozen": dead} and peers.held == {}
    await peers.refresh()
    assert peers.peers == {"frozen": dead}
    await peers.close()


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


@pytest.mark.timeout(30)
def test_a_round_left_with_nobody_gives_up_at_once():
    """A Future that never completes stands for hivemind's StepControl while its group waits for a frozen peer."""
    averager = SimpleNamespace(closing=False)
    left = time.monotonic() + 0.5
    started = time.monotonic()
    with pytest.raises(AllreduceException, match="stopped answering"):
        round_result(Future(), averager, 10.0, nobody_left=lambda: time.monotonic() > left)  # type: ignore[arg-type]
    assert time.monotonic() - started < 1.5, "waited for the round's timeout instead"
    started = time.monotonic()
    with pytest.raises(TimeoutError):  # peers still there: the round's own bound (2 x the timeout) holds
        round_result(Future(), averager, 0.2, nobody_left=lambda: False)  # type: ignore[arg-type]
    assert 0.35 < time.monotonic() - started < 2.0


@pytest.mark.timeout(30)
def test_a_round_in_flight_gives_up_once_its_averager_closes():
    """A stopping peer's round whose group never completes ends within a poll of its averager's shutdown, not at
    twice the averaging timeout (the server's shutdown waits for the compute thread that runs it): a gradient round,
    and a parameter-averaging round, which leaves the parameters as they were."""
    averager = SimpleNamespace(closing=False)
    threading.Timer(0.3, lambda: setattr(averager, "closing", True)).start()
    started = time.monotonic()
    with pytest.raises(AveragerClosed):
        round_result(Future(), averager, 10.0, nobody_left=lambda: False)  # type: ignore[arg-type]
    assert time.monotonic() - started < 1.5, "waited for the round's timeout instead"

    weight = torch.nn.Parameter(torch.ones(3))
    buffers = [torch.zeros(3)]
    round_in_flight = Future()
    averager = SimpleNamespace(
        closing=False,
        expect_group=lambda *_: None,
        get_tensors=lambda: contextlib.nullcontext(buffers),
        step=lambda **_: round_in_flight,
    )
    round_in_flight.cancel = lambda: True  # type: ignore[method-assign]  # hivemind's StepControl.cancel
    worker = SimpleNamespace(stage_params=[weight], changing_state=contextlib.nullcontext)
    threading.Timer(0.3, lambda: setattr(averager, "closing", True)).start()
    started = time.monotonic()
    no_probe = AveragingConfig(averaging_timeout=10.0, param_average_probe=False)  # the parameter round itself
    parameters = ParameterAveraging(averager, no_probe, get_codec("none"))  # type: ignore[arg-type]
    parameters.average(worker, 1)  # type: ignore[arg-type]
    assert time.monotonic() - started < 1.5, "the parameter round waited for its timeout instead"
    assert torch.equal(weight.detach(), torch.ones(3)) and parameters.bytes == 0


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
    )
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


async def test_a_stopping_peers_poller_ends_even_when_a_progress_kicks_it_as_it_is_cancelled():
    """`StageCollaboration.stop` cancels the poller and waits for it. A Progress that kicks the poller in the same
    step as the cancellation made Python 3.11's wait_for return instead of raising, and the poller ran on for ever:
    the server's stop, and a test's teardown, hung (CI, twice, 120 s). The poller's state only: no DHT, no peers."""
    collab = object.__new__(StageCollaboration)
    never = asyncio.get_running_loop().create_future()  # a read and an epoch check that are still running
    collab._kick, collab._refreshing, collab._checking = asyncio.Event(), never, never
    collab.cfg, collab.network = SimpleNamespace(progress_period=30.0), SimpleNamespace(announce_period=1e9)
    collab.phase = Phase.ACCUMULATING
    poller = asyncio.create_task(collab._poll_forever())
    await asyncio.sleep(0.05)  # waiting for a kick
    collab.phase = Phase.STOPPED  # what stop does, then
    collab._kick.set()  # a Progress arrives
    poller.cancel()
    done, _ = await asyncio.wait({poller}, timeout=2.0)
    poller.cancel()
    never.cancel()
    assert done, "the poller ran on after its peer stopped"
