"""What a stage peer's admissions prove (server/collab/served.py): the samples its part may weigh in our parts of the
round. Stage 0's keys come from a stand-in for the DHT read (the signatures are real RSA, hivemind's)."""

from __future__ import annotations

import types

import pytest

from dht.identity import Identity
from server.collab.served import LATE_EPOCHS, Served
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


@pytest.fixture
def served() -> Served:
    reads: list[int] = []

    async def discover(stage: int, include_pending: bool = False):
        reads.append(stage)
        return [types.SimpleNamespace(peer_id=STAGE0.peer_id, public_key=STAGE0.public_key)]

    return Served(Tickets(types.SimpleNamespace(discover=discover), timeout=1.0))


async def test_admissions_signed_by_stage_zero_prove_their_samples_once_for_one_peer_and_epoch(served):
    await served.prove(progress("b", 5, admission("m1", 5), admission("m2", 5, samples=2)))
    assert served.proven("b", 5) == 6
    # each Progress carries every admission of its epoch: the same ones again prove nothing more
    await served.prove(progress("b", 5, admission("m1", 5), admission("m2", 5, samples=2), admission("m3", 5)))
    assert served.proven("b", 5) == 10
    # nor for another epoch of the same peer, nor for another peer that relays them
    await served.prove(progress("b", 6, admission("m1", 5), admission("m4", 6)))
    await served.prove(progress("c", 5, admission("m1", 5), admission("m2", 5, samples=2)))
    assert (served.proven("b", 6), served.proven("c", 5), served.proven("b", 5)) == (4, 0, 10)


async def test_forged_foreign_stale_and_our_own_admissions_prove_nothing(served):
    ours = admission("ours", 5)
    served.tickets.spent[ticket_key(ours)] = None  # its Backward was served here
    await served.prove(
        progress(
            "b",
            5,
            admission("forged", 5, signer=Identity()),  # names STAGE0, signed by another key
            ours,
            admission("stale", 5 - LATE_EPOCHS - 1),
            admission("future", 7),  # no peer holds a batch two ahead of its epoch
        )
    )
    assert served.proven("b", 5) == 0
    assert served.forged == 1
    late = admission("late", 5 - LATE_EPOCHS)  # a Backward of an ended epoch joins the next one's gradients
    nobody = pb.Admission()
    nobody.CopyFrom(admission("unknown", 5))
    nobody.admitted_by = Identity().peer_id  # a signer stage 0's records do not list
    # one of the next batch (admitted early) is claimed for its own epoch, not this one
    await served.prove(progress("b", 5, late, nobody, admission("next", 6)))
    assert served.proven("b", 5) == 4
    await served.prove(progress("b", 6, admission("next", 6)))
    assert served.proven("b", 6) == 4
    served.forget_before(6)
    assert (served.proven("b", 5), served.proven("b", 6)) == (0, 4)


async def test_a_peer_we_have_heard_nothing_from_for_an_epoch_weighs_a_microbatch_at_most(served):
    """A joiner hears none of its peers' counts for the epoch the others are ending: a cap of 0 for each made its
    parts of the round 0/0. A peer with a Progress of that epoch weighs what it proved, nothing if it proved
    nothing."""
    assert served.cap("b", 5, unheard=64.0) == 64.0
    await served.prove(progress("b", 5))
    assert served.cap("b", 5, unheard=64.0) == 0.0
    await served.prove(progress("b", 5, admission("m1", 5)))
    assert served.cap("b", 5, unheard=64.0) == 4.0
    served.forget_before(6)
    assert served.cap("b", 5, unheard=64.0) == 64.0
