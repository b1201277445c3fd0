"""A peer that stops answering (frozen, dead, its link down) costs the stage seconds, not a timeout: the pieces.

The whole behaviour runs in tests/test_integration.py (`frozen_one`: a server SIGSTOPped for 20 s, its stall printed).
"""

import asyncio
import contextlib
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch
from hivemind.averaging.partition import AllreduceException

from dht.identity import Identity
from dht.records import PeerEntry, ServerRecord
from server.collab.compat.averager import AveragerClosed
from server.collab.epoch import Phase, StageCollaboration
from server.collab.progress import UNHEARD_HOLD_S, StagePeers
from server.collab.rounds import ParameterAveraging, round_result
from server.config import AveragingConfig
from swarm.compression import get_codec
from swarm.protocol import wire_pb2 as pb
from tests.conftest import free_port


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
    (a round would wait for it again), but a message from it must, if it once took one of ours there. A peer never
    heard from is held out too, briefly at first (it may still be starting), then ever longer (a record at an address
    nobody serves), and one that speaks but was never reached at its record's address stays held (its owner may speak
    from elsewhere)."""
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: the Progress fails at once (UNAVAILABLE)
    peers = StagePeers(ListingDHT({"frozen": dead}), stage=1, peer_timeout=1.0)
    await peers.refresh()
    assert peers.peers == {"frozen": dead}
    holds = []
    for _ in range(3):
        started = time.monotonic()
        await peers._send("frozen", dead, pb.StageProgress())
        assert peers.peers == {} and peers.held == {"frozen": dead}
        holds.append(peers._unreachable["frozen"] - started)
        peers._unreachable["frozen"] = 0.0  # its hold over: the next DHT read brings it back
        await peers.refresh()
        assert peers.peers == {"frozen": dead}
    first, _ = UNHEARD_HOLD_S
    assert [round(h / first) for h in holds] == [1, 2, 4], holds
    peers.record(pb.StageProgress(peer_id="frozen", epoch=0, samples=4))  # it speaks, from wherever it is
    await peers._send("frozen", dead, pb.StageProgress())
    assert peers.held == {"frozen": dead}
    reason = peers.unlisted(pb.StageProgress(peer_id="frozen"))
    assert reason is not None and "did not answer" in reason, "speaking brings back only a peer once reached there"
    assert peers.peers == {} and peers.held == {"frozen": dead}
    peers._unreachable["frozen"] = 0.0
    await peers.refresh()
    peers.took("frozen")  # it took a Progress at its record's address (it was alive there), then froze
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
