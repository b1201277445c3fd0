"""Stage 0's admission policy (server/collab/admission.py), on hand-made progress messages: no network."""

from types import SimpleNamespace

from server.collab.admission import Admission, Decision
from server.collab.progress import StagePeers
from swarm.protocol import wire_pb2 as pb


def peers_of_stage0(*others: str) -> StagePeers:
    peers = StagePeers(SimpleNamespace(peer_id="me"), stage=0, peer_timeout=1.0)  # type: ignore[arg-type]
    peers.peers = {p: f"127.0.0.1:{i + 1}" for i, p in enumerate(others)}
    return peers


def report(peers: StagePeers, peer: str, epoch: int, admitted: int, admitted_next: int = 0) -> None:
    peers.record(pb.StageProgress(peer_id=peer, epoch=epoch, admitted=admitted, admitted_next=admitted_next))


def admit_all(admission: Admission, epoch: int, n: int) -> list:
    """Admit microbatches of `n` samples until told otherwise; returns the batches they joined, then the decision."""
    placed = []
    while isinstance(where := admission.place(epoch), int):
        admission.record(where, n, epoch)
        placed.append(where)
    return [*placed, where]


def test_alone_a_peer_admits_the_global_batch_then_waits():
    admission = Admission(peers_of_stage0(), quota=32, lookahead=0)
    assert admit_all(admission, 0, 8) == [0, 0, 0, 0, Decision.WAIT]
    assert admit_all(admission, 1, 8) == [1, 1, 1, 1, Decision.WAIT], "the next epoch opens a new batch"


def test_lookahead_admits_part_of_the_next_batch_early():
    admission = Admission(peers_of_stage0(), quota=32, lookahead=16)
    assert admit_all(admission, 0, 8) == [0, 0, 0, 0, 1, 1, Decision.WAIT]
    assert admit_all(admission, 1, 8) == [1, 1, 2, 2, Decision.WAIT], "the early ones count towards their batch"


def test_two_peers_admitting_at_once_never_overfill_the_batch():
    """Each reserves the other's share before it knows what the other admitted: no overshoot even with no messages."""
    a, b = peers_of_stage0("b"), peers_of_stage0("me")
    a_admission, b_admission = Admission(a, quota=32, lookahead=0), Admission(b, quota=32, lookahead=0)
    placed_a, placed_b = admit_all(a_admission, 0, 8), admit_all(b_admission, 0, 8)
    assert placed_a[:-1] == placed_b[:-1] == [0, 0], (placed_a, placed_b)
    assert placed_a[-1] is placed_b[-1] is Decision.REFUSE, "neither knows yet that the other is full"
    report(a, "b", epoch=0, admitted=16)
    assert a_admission.place(0) is Decision.WAIT, "now it knows: the batch is complete"


def test_a_full_share_refuses_while_another_peer_has_room():
    """The trainer takes a refused microbatch to another peer of stage 0 at once."""
    peers = peers_of_stage0("b")
    admission = Admission(peers, quota=32, lookahead=0)
    report(peers, "b", epoch=0, admitted=8)
    assert admit_all(admission, 0, 8) == [0, 0, Decision.REFUSE]
    report(peers, "b", epoch=0, admitted=16)
    assert admission.place(0) is Decision.WAIT


def test_a_peer_that_stopped_admitting_releases_its_share():
    """A peer that trainers no longer send Forwards to (banned, paused) must not hold half of every batch."""
    peers = peers_of_stage0("idle")
    report(peers, "idle", epoch=0, admitted=0)
    admission = Admission(peers, quota=32, lookahead=0)
    assert admit_all(admission, 0, 8)[:-1] == [0, 0], "a peer we just met reserves its share"
    assert admit_all(admission, 3, 8) == [3, 3, 3, 3, Decision.WAIT], "two epochs on, it has admitted nothing"
