"""Stage 0's admission policy (server/collab/admission.py), on hand-made progress messages: no network."""

from types import SimpleNamespace

import pytest

from server.collab.admission import Admission, Decision
from server.collab.progress import StagePeers
from swarm.protocol import wire_pb2 as pb


def stage0_peer(me: str, *others: str, quota: int = 32, lookahead: int = 0) -> Admission:
    peers = StagePeers(SimpleNamespace(peer_id=me, p2p=None), stage=0, peer_timeout=1.0)  # type: ignore[arg-type]
    peers.peers = {p: f"127.0.0.1:{i + 1}" for i, p in enumerate(others)}
    return Admission(peers, quota=quota, lookahead=lookahead)


def report(admission: Admission, peer: str, epoch: int, admitted: int, admitted_next: int = 0, admitting=True):
    admission.peers.record(
        pb.StageProgress(
            peer_id=peer,
            epoch=epoch,
            admitted=admitted,
            admitted_next=admitted_next,
            stopped_admitting=not admitting,
        )
    )


def admit_all(admission: Admission, epoch: int, n: int) -> list:
    """Admit microbatches of `n` samples until told otherwise; returns the batches they joined, then the decision."""
    placed = []
    while isinstance(where := admission.place(epoch, n), int):
        admission.record(where, n, epoch)
        placed.append(where)
    return [*placed, where]


def test_alone_a_peer_admits_the_global_batch_then_waits():
    admission = stage0_peer("me")
    assert admit_all(admission, 0, 8) == [0, 0, 0, 0, Decision.WAIT]
    assert admit_all(admission, 1, 8) == [1, 1, 1, 1, Decision.WAIT], "the next epoch opens a new batch"


def test_lookahead_admits_part_of_the_next_batch_early():
    admission = stage0_peer("me", lookahead=16)
    assert admit_all(admission, 0, 8) == [0, 0, 0, 0, 1, 1, Decision.WAIT]
    assert admit_all(admission, 1, 8) == [1, 1, 2, 2, Decision.WAIT], "the early ones count towards their batch"


@pytest.mark.parametrize("n_peers, batch", [(2, 8), (3, 8), (2, 12), (3, 12), (4, 5), (1, 12)])
def test_peers_admitting_at_once_fill_the_batch_and_overfill_it_by_less_than_a_microbatch(n_peers, batch):
    """Every peer admits before it hears of the others (the start of every epoch), then they exchange counts; the
    batch ends up complete, and overfilled by less than one microbatch (the batch must reach the quota to end)."""
    names = [f"p{i}" for i in range(n_peers)]
    peers = {me: stage0_peer(me, *(p for p in names if p != me)) for me in names}
    for _ in range(4):  # rounds: everyone admits what it may, then everyone tells everyone
        for admission in peers.values():
            admit_all(admission, 0, batch)
        for me, admission in peers.items():
            for other in names:
                if other != me:
                    report(admission, other, 0, peers[other].admitted.get(0, 0))
    total = sum(a.admitted.get(0, 0) for a in peers.values())
    assert 32 <= total < 32 + batch, {me: a.admitted for me, a in peers.items()}
    assert all(a.place(0, batch) is Decision.WAIT for a in peers.values())


def test_a_full_share_refuses_while_another_peer_has_room():
    """The trainer takes a refused microbatch to another peer of stage 0 at once."""
    admission = stage0_peer("me", "b")  # "b" < "me": b holds the remainder
    report(admission, "b", epoch=0, admitted=8)
    assert admit_all(admission, 0, 8) == [0, 0, Decision.REFUSE]
    report(admission, "b", epoch=0, admitted=16)
    assert admission.place(0, 8) is Decision.WAIT


def test_a_peer_that_stopped_admitting_releases_its_share():
    """A peer that trainers no longer send Forwards to (banned), or that leaves the stage, must not hold part of
    every batch."""
    admission = stage0_peer("me", "idle")
    report(admission, "idle", epoch=0, admitted=0)
    assert admit_all(admission, 0, 8)[:-1] == [0, 0], "a peer we just met holds its share"
    assert admit_all(admission, 3, 8) == [3, 3, 3, 3, Decision.WAIT], "two epochs on, it has admitted nothing"
    leaving = stage0_peer("me", "leaving")
    report(leaving, "leaving", epoch=0, admitted=8, admitting=False)
    assert admit_all(leaving, 0, 8) == [0, 0, 0, Decision.WAIT], "it said it no longer admits: its 8 stay counted"


def test_a_released_admission_makes_room_again():
    admission = stage0_peer("me")
    admit_all(admission, 0, 8)
    admission.release(0, 8)  # e.g. the request expired in the queue before it was computed
    assert admission.place(0, 8) == 0


def test_a_peer_that_joins_after_another_admitted_alone_takes_only_what_is_left():
    """A peer of stage 0 that admitted before any other was listed holds more than its share: a peer that joins then
    and hears its count admits only what the batch has left, not a share of its own (the batch would overfill and
    its last microbatches run after it stepped)."""
    first = stage0_peer("p0", quota=16)
    assert admit_all(first, 0, 4) == [0, 0, 0, 0, Decision.WAIT]
    joiner = stage0_peer("p1", "p0", quota=16)
    report(joiner, "p0", 0, admitted=16)
    assert admit_all(joiner, 0, 4) == [Decision.WAIT]
    late = stage0_peer("p1", "p0", quota=16)
    report(late, "p0", 0, admitted=12)  # the first had admitted three microbatches alone
    assert admit_all(late, 0, 4) == [0, Decision.WAIT]


def claim_message(peer: str, epoch: int) -> pb.StageProgress:
    return pb.StageProgress(peer_id=peer, epoch=epoch, claims=True)


def test_a_peer_idle_for_epochs_claims_its_share_before_it_admits_so_the_batch_never_overfills():
    """A peer of stage 0 that trainers had not sent Forwards to for two epochs (it joined late, or was banned) holds
    no share in the others' eyes: they admit the whole batch. Were it to admit its share the moment a trainer finds
    it, the batch would overfill by that share (CI saw 24 samples in a global batch of 16). It claims first: the
    others count its share from then on, and their answers say what they had admitted by then."""
    busy, idle = stage0_peer("a", "b", quota=16), stage0_peer("b", "a", quota=16)
    report(busy, "b", epoch=0, admitted=0)
    assert busy.peers.admitting(3) == [], '"b" holds no share: "a" may admit all 16'
    for _ in range(2):  # "a" admitted 8 so far
        assert busy.place(3, 4) == 3
        busy.record(3, 4, 3)
    assert idle.peers.must_claim(3), "no peer has answered a claim of ours yet"

    busy.peers.record(claim_message("b", 3))  # what `claim` sends; "a" answers with its counts (8, 0)
    report(idle, "a", epoch=3, admitted=busy.counts(3)[0])
    assert admit_all(busy, 3, 4) == [Decision.REFUSE], "its share is 8 again, and it holds 8"
    assert admit_all(idle, 3, 4) == [3, 3, Decision.WAIT]
    assert busy.admitted[3] + idle.admitted[3] == 16
    assert busy.peers.admitting(4) == ["b"] and busy.peers.admitting(5) == [], "a claim covers its epoch and the next"


async def test_a_claim_leaves_out_peers_that_refuse_it_or_answer_garbage(monkeypatch):
    """A peer that does not count our share may admit the whole batch, so it must not count in ours either; and one
    hostile peer refusing every claim must not stop the others from admitting."""
    admission = stage0_peer("me", "good", "garbage", "huge", "refusing", quota=16)
    answers = {
        "good": pb.ProgressAck(epoch=3, admitted=8, admitted_next=4),
        "garbage": pb.ProgressAck(admitted=-5),
        "huge": pb.ProgressAck(admitted_next=2**62),  # "the batch is full": we would never admit again
    }

    async def broadcast(*args, **kwargs):
        assert kwargs["claims"]
        return answers  # "refusing" answered PERMISSION_DENIED: broadcast leaves it out

    monkeypatch.setattr(admission.peers, "broadcast", broadcast)
    assert admission.peers.must_claim(3)
    assert await admission.peers.claim(3, 0, (0, 0), most=20)
    assert list(admission.peers.peers) == ["good"] and set(admission.peers.held) == {"garbage", "huge", "refusing"}
    assert admission.peers.admitted_by("good", 3) == 8 and admission.peers.admitted_by("good", 4) == 4
    assert admission.peers.admitted_by("garbage", 3) == 0 and admission.peers.admitted_by("huge", 4) == 0
    assert not admission.peers.must_claim(4), "a claim answered at epoch 3 covers epoch 4"
    assert admission.peers.must_claim(5)
