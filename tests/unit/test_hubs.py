"""The stage's hubs (server/collab/hubs.py): who they are, and that what a hub logs reaches every peer it lists, once,
in order, in a few calls, whatever peers fail or join."""

import asyncio
import collections

import pytest

from dht.identity import Identity, fingerprint
from server.collab import hubs
from server.collab.hubs import Hub, hubs_for
from server.schema import forged_progress
from swarm.protocol import wire_pb2 as pb


def test_every_peer_names_the_same_hubs_and_they_change_with_the_epoch():
    peers = [f"k{i:032x}" for i in range(16)]
    assert hubs_for(7, peers) == hubs_for(7, reversed(peers)) == hubs_for(7, peers + peers[:3])
    assert len(hubs_for(7, peers)) == hubs.HUBS and len(set(hubs_for(7, peers))) == hubs.HUBS
    assert hubs_for(7, peers, 4)[:2] == hubs_for(7, peers)
    # over many epochs every peer carries about its share (2 of 16)
    counts = collections.Counter(h for epoch in range(2000) for h in hubs_for(epoch, peers))
    assert set(counts) == set(peers) and max(counts.values()) < 2 * 2000 * 2 / 16
    # a peer that is gone hands its epochs to the next in hash order, the other hub stays
    first, second = hubs_for(7, peers)
    assert hubs_for(7, [p for p in peers if p != first])[0] == second
    assert hubs_for(7, ["only"]) == ["only"] and hubs_for(7, []) == []


def test_a_hub_calls_each_peer_at_most_once_a_period_however_many_peers():
    assert hubs.period(2) == hubs.PERIOD_S[0] and hubs.period(10_000) == hubs.PERIOD_S[1]
    assert hubs.period(60) == pytest.approx(60 / hubs.HUB_CALLS_PER_S)


def _msg(peer: str, epoch: int, samples: int) -> pb.StageProgress:
    return pb.StageProgress(peer_id=peer, epoch=epoch, samples=samples, signature=f"{peer}/{epoch}/{samples}".encode())


class Stage:
    """Peers a hub calls: each keeps what it was passed, in order; `down` ones fail their calls."""

    def __init__(self, n: int):
        self.peers = {f"p{i}": f"127.0.0.1:{i + 1}" for i in range(n)}
        self.taken: dict[str, list[bytes]] = {p: [] for p in self.peers}
        self.calls: dict[str, int] = dict.fromkeys(self.peers, 0)
        self.down: set[str] = set()

    async def send(self, peer_id: str, address: str, msg: pb.StageProgress) -> pb.ProgressAck | None:
        assert self.peers[peer_id] == address and msg.signature == b"sealed"
        self.calls[peer_id] += 1
        await asyncio.sleep(0)
        if peer_id in self.down:
            return None
        self.taken[peer_id] += [m.signature for m in msg.passed_on]
        return pb.ProgressAck()


def _seal(passed_on: list[pb.StageProgress]) -> pb.StageProgress:
    envelope = pb.StageProgress(peer_id="hub", signature=b"sealed")
    envelope.passed_on.extend(passed_on)
    return envelope


async def test_what_a_hub_logs_reaches_every_peer_once_in_order_in_few_calls(monkeypatch):
    monkeypatch.setattr(hubs, "PERIOD_S", (0.02, 0.02))
    stage = Stage(6)
    hub = Hub(stage.send, lambda: stage.peers, _seal)
    try:
        sent = []
        for i in range(40):  # a burst: batched into a few calls
            msg = _msg(f"p{i % 6}", 3, i)
            sent.append(msg.signature)
            hub.add(msg)
        await asyncio.sleep(0.3)
        assert all(taken == sent for taken in stage.taken.values())
        assert max(stage.calls.values()) <= 2, stage.calls
        # a peer that failed gets what it missed when it answers again, the others only what is new
        stage.down.add("p1")
        hub.add(_msg("p0", 3, 100))
        await asyncio.sleep(0.3)
        stage.down.clear()
        hub.add(_msg("p0", 3, 101))
        await asyncio.sleep(0.3)
        assert stage.taken["p1"] == [*sent, b"p0/3/100", b"p0/3/101"] == stage.taken["p2"]
        # a peer the hub lists only now gets the log of its last two epochs
        stage.peers["late"] = "127.0.0.1:99"
        stage.taken["late"], stage.calls["late"] = [], 0
        hub.add(_msg("p0", 4, 1))
        hub.add(_msg("p0", 5, 1))  # epoch 3 is now older than the hub keeps
        await asyncio.sleep(0.3)
        assert stage.taken["late"] == [b"p0/4/1", b"p0/5/1"]
    finally:
        await hub.close()


async def test_a_peer_far_behind_gets_the_log_in_bounded_calls_and_an_ending_goes_at_once(monkeypatch):
    monkeypatch.setattr(hubs, "PERIOD_S", (5.0, 5.0))  # only urgency moves it within the test
    monkeypatch.setattr(hubs, "MAX_PASSED_ON", 8)
    stage = Stage(2)
    hub = Hub(stage.send, lambda: stage.peers, _seal)
    try:
        for i in range(20):
            hub._log.append(_msg("p0", 1, i))  # logged before the loop ran
        hub.add(_msg("p0", 1, 20), urgent=True)  # ends an epoch: no wait for the period
        await asyncio.sleep(0.2)
        assert [len(t) for t in stage.taken.values()] == [21, 21]
        assert stage.calls == {"p0": 3, "p1": 3}  # 8 + 8 + 5
    finally:
        await hub.close()


async def test_a_hub_with_nothing_of_its_own_to_carry_messages_waits(monkeypatch):
    monkeypatch.setattr(hubs, "PERIOD_S", (0.01, 0.01))
    stage = Stage(3)
    own: list[pb.StageProgress] = []
    hub = Hub(stage.send, lambda: stage.peers, lambda passed: _seal(passed) if own else None)
    try:
        hub.add(_msg("p0", 1, 1))
        await asyncio.sleep(0.1)
        assert not any(stage.calls.values())
        own.append(_msg("hub", 1, 0))
        hub.add(_msg("p0", 1, 2))
        await asyncio.sleep(0.1)
        assert all(t == [b"p0/1/1", b"p0/1/2"] for t in stage.taken.values())
    finally:
        await hub.close()


def test_an_envelope_carries_the_hubs_latest_count_signed_anew_without_what_only_its_own_message_may_say():
    me = Identity()
    latest = pb.StageProgress(
        peer_id=fingerprint(me.public_key),
        public_key=me.public_key,
        epoch=3,
        samples=40,
        end_epoch=True,
        claims=True,
        via_hub=True,
        served=[pb.Admission(microbatch_id="m")],
        taken_epoch=2,
    )
    latest.signature = me.sign(latest.SerializeToString())
    passed = [_msg("a", 3, 8), _msg("b", 3, 16)]
    envelope = hubs.seal(latest, passed, me.sign)
    assert forged_progress(envelope) is None and envelope.signature != latest.signature
    assert (envelope.epoch, envelope.samples, list(envelope.passed_on)) == (3, 40, passed)
    assert not (envelope.end_epoch or envelope.claims or envelope.via_hub or envelope.served)
    assert not envelope.HasField("taken_epoch")
    assert latest.end_epoch and not latest.passed_on  # the original is left as it was


def test_a_peer_skips_a_message_it_took_until_it_has_taken_seen_kept_newer_ones(monkeypatch):
    monkeypatch.setattr(hubs, "SEEN_KEPT", 3)
    seen = hubs.Seen()
    first, *rest = [_msg("a", 0, n) for n in range(4)]
    seen.add(first)
    assert seen(first) and not seen(rest[0])
    for msg in rest[:2]:
        seen.add(msg)
    assert seen(first)
    seen.add(rest[2])
    assert not seen(first) and all(seen(m) for m in rest)


def test_a_sender_makes_a_hub_pass_on_at_once_once_an_epoch_however_often_it_asks_to_end_it():
    first = hubs.FirstEnds()
    assert not first("a", 5, False, 5), "a count that ends nothing waits for the period"
    assert first("a", 5, True, 5) and not any(first("a", 5, True, 5) for _ in range(10))
    assert first("b", 5, True, 5), "another sender's first end of the epoch"
    assert first("a", 6, True, 6) and not first("a", 6, True, 6), "the next epoch: once more"
    assert not first("a", 5, True, 6), "an old epoch's ends stay spent"
    assert not any(first("c", e, True, 6) for e in (7, 8, 10**12, -1)), "naming other epochs than ours gets nothing"
