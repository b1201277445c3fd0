"""What a stage peer's admissions prove (server/collab/served.py): the samples its part may weigh in our parts of the
round. Stage 0's keys come from a stand-in for the DHT read (the signatures are real RSA, hivemind's)."""

from __future__ import annotations

import types

import pytest

from dht.identity import Identity
from server.collab.progress import StagePeers
from server.collab.served import ForgedAdmission, Served
from server.collab.tickets import Tickets, ticket_bytes, ticket_key
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import PROTOCOL_VERSION

STAGE0 = Identity()  # the stage-0 peer that admits every microbatch here


def admission(microbatch_id: str, global_batch: int, samples: int = 4, signer: Identity = STAGE0) -> pb.Admission:
    signature = signer.sign(ticket_bytes(microbatch_id, samples, global_batch, global_batch))
    return pb.Admission(
        microbatch_id=microbatch_id,
        samples=samples,
        global_batch=global_batch,
        admitted_at=global_batch,
        admitted_by=STAGE0.peer_id,  # every one names STAGE0; `signer` may be someone else
        signature=signature,
    )


def progress(sender: str, epoch: int, *served: pb.Admission) -> pb.StageProgress:
    return pb.StageProgress(protocol_version=PROTOCOL_VERSION, stage=1, peer_id=sender, epoch=epoch, served=served)


def receiver(listed: list[Identity] | None = None, reads: list[int] | None = None) -> Served:
    """A stage peer's `Served`, whose reads of stage 0 list `listed` as they stand at the read (STAGE0 by default),
    each read appended to `reads`."""

    async def discover(stage: int, include_pending: bool = False):
        if reads is not None:
            reads.append(stage)
        return [types.SimpleNamespace(peer_id=i.peer_id, public_key=i.public_key) for i in listed or [STAGE0]]

    return Served(Tickets(types.SimpleNamespace(discover=discover), timeout=1.0))


def sender(identity: Identity, send) -> StagePeers:
    """A stage peer's `StagePeers` whose Progress messages go to `send(peer_id, address, msg)` instead of gRPC."""
    peers = StagePeers(types.SimpleNamespace(identity=identity, peer_id=identity.peer_id, p2p=None), 1, 1.0)
    peers._send = send  # type: ignore[method-assign]
    return peers


@pytest.fixture
def served() -> Served:
    return receiver()


async def test_admissions_signed_by_stage_zero_prove_their_samples_once_per_peer(served):
    await served.prove(progress("b", 5, admission("m1", 5), admission("m2", 5, samples=2)), 5)
    assert served.proven("b", 5) == 6
    # a Progress may carry admissions it carried before (a receiver that restarted gets them all): they prove nothing more
    await served.prove(progress("b", 5, admission("m1", 5), admission("m2", 5, samples=2), admission("m3", 5)), 5)
    assert served.proven("b", 5) == 10
    # nor for a later epoch of the same peer
    await served.prove(progress("b", 6, admission("m1", 5), admission("m4", 6)), 6)
    assert served.proven("b", 6) == 4
    # another peer naming them counts them too (a Backward retried there; or a copy, which the group's weight bound
    # limits): counting them for the first peer alone would let a peer that saw them in a Forward take them
    await served.prove(progress("c", 5, admission("m1", 5), admission("m2", 5, samples=2)), 5)
    assert (served.proven("c", 5), served.proven("b", 5)) == (6, 10)


async def test_a_forged_admission_refuses_its_progress_and_early_or_our_own_prove_nothing(served):
    with pytest.raises(ForgedAdmission):  # names STAGE0, signed by another key
        await served.prove(progress("b", 5, admission("m1", 5), admission("forged", 5, signer=Identity())), 5)
    assert served.forged == 1
    ours = admission("ours", 5)
    served.tickets.spent[ticket_key(ours)] = None  # its Backward was served here: relayed, it proves nothing
    await served.prove(progress("b", 5, ours, admission("future", 7)), 5)
    assert served.proven("b", 5) == 0
    late = admission("late", 1)  # a Backward of an ended epoch joins the current one's gradients, however late
    # one of the next batch (admitted early) is claimed for its own epoch, not this one
    await served.prove(progress("b", 5, late, admission("next", 6)), 5)
    assert served.proven("b", 5) == 4
    await served.prove(progress("b", 6, admission("next", 6)), 6)
    assert served.proven("b", 6) == 4
    served.forget_before(6)
    assert (served.proven("b", 5), served.proven("b", 6)) == (0, 4)


async def test_the_stage_holds_each_microbatch_of_its_batch_once_and_a_later_admission_shows_stage_zero_moved_on(
    served,
):
    """What may end an epoch without our own count (epoch.py `_may_end`): the samples of its global batch the stage's
    peers proved, each microbatch once, or stage 0's admission of a later epoch. A listed liar that names the
    admissions it saw in other peers' messages, replays those of an ended epoch, or names this epoch's under the next
    adds nothing to what the stage holds of either."""
    await served.prove(progress("b", 4, admission("old", 4)), 4)
    await served.prove(progress("b", 5, admission("m1", 5), admission("m2", 5)), 5)
    assert served.distinct(5) == 8 and served.tickets.latest_at == 5
    await served.prove(progress("liar", 5, admission("m1", 5), admission("m2", 5), admission("old", 4)), 5)
    assert served.proven("liar", 5) == 12  # its part may weigh copies (the group's bound limits them), but
    assert served.distinct(5) == 8  # the stage holds no more of the batch
    await served.prove(progress("liar", 6, admission("m3", 5)), 5)  # a microbatch of batch 5, dated 6
    await served.prove(progress("c", 5, admission("m3", 5), admission("late", 3)), 5)
    assert (served.distinct(5), served.distinct(6)) == (12, 0)  # a late Backward joins the gradients, not the batch
    served.tickets.spent[ticket_key(admission("m3", 5))] = None  # its Backward came here again: the worker counts it
    assert served.distinct(5) == 8

    shown = progress("b", 5)
    shown.moved_on.CopyFrom(admission("next", 6))
    await served.prove(shown, 5)
    assert served.tickets.latest_at == 6
    forged = progress("liar", 5)
    forged.moved_on.CopyFrom(admission("far", 9, signer=Identity()))
    with pytest.raises(ForgedAdmission):
        await served.prove(forged, 5)
    unknown = progress("liar", 5)
    unknown.moved_on.CopyFrom(admission("far", 9))
    unknown.moved_on.admitted_by = Identity().peer_id  # a signer stage 0 does not list: it proves nothing
    await served.prove(unknown, 5)
    assert served.tickets.latest_at == 6
    served.forget_before(6)
    assert served.distinct(5) == 0


async def test_a_peer_we_have_heard_nothing_from_for_an_epoch_weighs_a_microbatch_at_most(served):
    """A joiner hears none of its peers' counts for the epoch the others are ending: a cap of 0 for each made its
    parts of the round 0/0. A peer with a Progress of that epoch weighs what it proved, nothing if it proved
    nothing."""
    assert served.cap("b", 5, unheard=64.0) == 64.0
    unknown = admission("unknown", 5)
    unknown.admitted_by = Identity().peer_id  # a signer stage 0's records do not list
    await served.prove(progress("b", 5, unknown), 5)
    assert served.cap("b", 5, unheard=64.0) == 64.0
    await served.settle(5)  # read stage 0 again: still unknown, so it proves nothing
    assert served.cap("b", 5, unheard=64.0) == 64.0
    await served.prove(progress("b", 5), 5)
    assert served.cap("b", 5, unheard=64.0) == 0.0
    claim = progress("b", 5, admission("m1", 5))
    claim.claims = True  # a stage-0 claim carries the admissions behind its count, as any Progress does
    await served.prove(claim, int(claim.epoch))
    assert served.cap("b", 5, unheard=64.0) == 4.0
    served.forget_before(6)
    assert served.cap("b", 5, unheard=64.0) == 64.0


async def test_a_delayed_peer_proves_the_round_it_is_in_while_it_reports_the_next_epoch(served):
    """With delayed steps a peer reports epoch e + 1 while its round of e runs; its Progress also carries e's
    admissions (`taken`), so a peer that joined during that round, and heard nothing of e, weighs it right."""
    msg = progress("b", 6, admission("n1", 6))
    msg.taken_epoch = 5
    msg.taken.extend([admission("m1", 5), admission("m2", 5)])
    await served.prove(msg, int(msg.epoch))
    assert (served.proven("b", 5), served.proven("b", 6)) == (8, 4)
    assert served.cap("b", 5, unheard=64.0) == 8.0


async def test_an_admission_whose_signer_we_read_late_counts_before_the_round():
    """A stage-0 peer that joined after our last read of stage 0 signs a microbatch whose gradient a stage peer
    holds. Its Progress reaches us before our read lists that signer: the admission proves nothing yet, and our part
    would weigh that peer below its samples (the tied swarm test left one process by 1.5e-2 in CI that way). Before
    the round (`settle`) we read stage 0 again and count it; a signer still unlisted then proves nothing."""
    joiner = Identity()
    listed = [STAGE0]
    reads: list[int] = []
    served = receiver(listed, reads)
    await served.prove(progress("b", 5, admission("m1", 5)), 5)
    late = admission("m2", 5, signer=joiner)
    late.admitted_by = joiner.peer_id
    await served.prove(progress("b", 5, admission("m1", 5), late), 5)  # read: the joiner's record is not there yet
    assert served.cap("b", 5, unheard=64.0) == 4.0
    stranger = admission("m3", 5, signer=Identity())
    stranger.admitted_by = Identity().peer_id
    await served.prove(progress("c", 5, stranger), 5)
    listed.append(joiner)  # its record is in the DHT now
    before = len(reads)
    await served.settle(5)
    assert len(reads) == before + 1  # one read for both
    assert served.cap("b", 5, unheard=64.0) == 8.0
    assert served.cap("c", 5, unheard=64.0) == 64.0  # heard of nothing we could check: a microbatch at most
    await served.settle(6)  # no admission of epoch 6 waits: no read
    assert len(reads) == before + 1


async def test_a_progress_carries_only_the_admissions_a_peer_does_not_hold_yet():
    """Each Progress used to carry every admission of its epoch: M backwards an epoch sent M(M+1)/2 admissions to
    each peer (~430 bytes each). A receiver's answer says how many of the sender's it holds, and the sender's next
    messages leave those out; one that holds fewer than it was sent (it restarted) gets them all again. Its part
    weighs the same either way."""
    me = Identity()
    receivers = {"r1": receiver(), "r2": receiver()}
    carried: list[int] = []

    async def send(peer_id: str, address: str, msg: pb.StageProgress) -> pb.ProgressAck:
        carried.append(len(msg.served))
        served = receivers[peer_id]
        await served.prove(msg, int(msg.epoch))
        return pb.ProgressAck(epoch=msg.epoch, served_held=served.held(msg.peer_id, int(msg.epoch)))

    peers = sender(me, send)
    peers.peers.update({name: f"127.0.0.1:{port}" for port, name in enumerate(receivers, start=1)})
    admissions = [admission(f"m{i}", 5) for i in range(8)]
    for n in range(1, 5):
        await peers.broadcast(5, 4 * n, False, served=admissions[:n])
    assert carried == [1, 1, 1, 1, 1, 1, 1, 1]  # one new admission per message, to each of the two peers
    assert all(served.cap(me.peer_id, 5, unheard=64.0) == 16.0 for served in receivers.values())

    receivers["r2"] = receiver()  # r2 restarted: it holds nothing of ours
    carried.clear()
    await peers.broadcast(5, 20, False, served=admissions[:5])
    await peers.broadcast(5, 24, False, served=admissions[:6])
    assert carried == [1, 1, 6, 6]  # told it holds 1 of 5, we send all six again (to r1 too: one signed message)
    assert [served.cap(me.peer_id, 5, unheard=64.0) for served in receivers.values()] == [24.0, 24.0]

    carried.clear()
    await peers.broadcast(6, 4, False, served=[admission("n0", 6)])  # a new epoch: nobody holds any of it yet
    await peers.broadcast(6, 4, False, served=[admission("n0", 6)])
    assert carried == [1, 1, 0, 0]

    # a receiver answering that it holds 2**32 - 1 of ours (a liar, or garbage) only goes without what it lacks:
    # the honest one still gets every admission it lacks, one message for both
    honest, liar, other = receiver(), receiver(), Identity()

    async def answer(peer_id: str, address: str, msg: pb.StageProgress) -> pb.ProgressAck:
        served = honest if peer_id == "honest" else liar
        await served.prove(msg, int(msg.epoch))
        held = served.held(msg.peer_id, int(msg.epoch)) if served is honest else 2**32 - 1
        return pb.ProgressAck(epoch=msg.epoch, served_held=held)

    peers = sender(other, answer)
    peers.peers.update({"honest": "127.0.0.1:1", "liar": "127.0.0.1:2"})
    for n in range(1, 4):
        await peers.broadcast(7, 4 * n, False, served=[admission(f"k{i}", 7) for i in range(n)])
    assert honest.cap(other.peer_id, 7, unheard=64.0) == 12.0


async def test_admissions_we_cannot_check_yet_come_again_and_far_epochs_are_not_kept():
    """A receiver does not say it holds an admission whose signer it does not know yet: the sender sends its
    admissions again in every message until the receiver can check them all (were it held, its sender would never
    send it again, and one whose recheck was lost would never count). Admissions of epochs far from ours are neither
    counted nor kept."""
    joiner = Identity()
    listed = [STAGE0]
    served = receiver(listed)
    me = Identity()
    carried: list[int] = []

    async def send(peer_id: str, address: str, msg: pb.StageProgress) -> pb.ProgressAck:
        carried.append(len(msg.served))
        await served.prove(msg, current=5)
        return pb.ProgressAck(epoch=5, served_held=served.held(msg.peer_id, int(msg.epoch)))

    peers = sender(me, send)
    peers.peers["r"] = "127.0.0.1:1"
    late = admission("m1", 5, signer=joiner)
    late.admitted_by = joiner.peer_id
    mine = [admission("m0", 5), late]
    await peers.broadcast(5, 8, False, served=mine)
    await peers.broadcast(5, 8, False, served=mine)
    assert carried == [2, 2] and served.proven(me.peer_id, 5) == 4  # all again: it holds 1 of 2
    listed.append(joiner)
    await peers.broadcast(5, 8, False, served=mine)
    await peers.broadcast(5, 8, False, served=mine)
    assert carried == [2, 2, 2, 0] and served.proven(me.peer_id, 5) == 8

    far = progress("liar", 105, admission("x", 105))
    far.taken_epoch = 104
    far.taken.append(admission("y", 104))
    await served.prove(far, current=5)
    assert served.held("liar", 105) == 0 and served.proven("liar", 105) == 0 == served.proven("liar", 104)
    assert served.cap("liar", 105, unheard=64.0) == 64.0
