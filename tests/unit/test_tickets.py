"""Stage 0 signs its admissions; other stages act on a call's global batch and admission epoch only when a stage-0 peer
signed them for that microbatch (server/collab/tickets.py). Real in-process peers (tests/peers.py): one serving stage
0, one serving stage 1 (the last), and calls made by hand as a hostile trainer would."""

import asyncio
import types

import pytest

from dht.identity import Identity
from server.collab.tickets import READ_INTERVAL_S, TicketRefused, Tickets, TicketUnchecked, ticket_bytes
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import PROTOCOL_VERSION
from tests.peers import MODEL
from trainer.client import Admission

pytestmark = pytest.mark.timeout(30)
B, T, D = 2, MODEL.max_seq_len, MODEL.d_model


def meta_of(ticket: Admission, microbatch_id: str = "mb-1", **changes) -> pb.CallMeta:
    meta = pb.CallMeta(
        protocol_version=PROTOCOL_VERSION,
        microbatch_id=microbatch_id,
        stage=1,
        global_batch=ticket.global_batch,
        admitted_at=ticket.admitted_at,
        admitted_by=ticket.signer,
        admission_signature=ticket.signature,
    )
    for name, value in changes.items():
        if value is None:
            meta.ClearField(name)
        else:
            setattr(meta, name, value)
    return meta


def signed_by(identity: Identity, microbatch_id: str, global_batch: int, admitted_at: int) -> Admission:
    signature = identity.sign(ticket_bytes(microbatch_id, B, global_batch, admitted_at))
    return Admission(global_batch, admitted_at, identity.peer_id, signature)


async def test_a_signer_we_could_not_look_up_is_unchecked_not_refused():
    """A call signed by a key this peer does not know: if its DHT read of stage 0 completed and does not list the key,
    PERMISSION_DENIED (a forgery); if the read failed (a DHT node that does not answer), we cannot tell, so the call
    is UNAVAILABLE ("behind: ...", the trainer asks again without a ban) and nothing is spent."""
    stranger = Identity()
    meta = meta_of(signed_by(stranger, "mb-1", 3, 3))
    answers: list = []

    async def discover(stage: int, include_pending: bool = False):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    tickets = Tickets(types.SimpleNamespace(discover=discover), timeout=1.0)
    answers.append(TimeoutError("the DHT did not answer"))
    with pytest.raises(TicketUnchecked, match="^behind:"):
        await tickets.check(meta, B, backward=True)
    assert not tickets.spent
    await asyncio.sleep(READ_INTERVAL_S)  # the next read may run
    answers.append([])  # the DHT answered: no stage-0 peer has this key
    with pytest.raises(TicketRefused, match="does not list"):
        await tickets.check(meta, B, backward=True)


async def test_a_stage_zero_signer_counts_only_once_its_server_answered_as_it():
    """Past stage 0, an admission counts only once the server at its signer's record address answered Info as that
    signer, on stage 0: a signed stage-0 record at an address nobody serves (or where another server answers) gets
    its microbatches UNAVAILABLE ("behind: ...") and nothing is spent or accumulated. Before, they were computed and
    accumulated, and the stage stepped on more samples than stage 0 admitted."""
    honest, sybil = Identity(), Identity()
    records = {honest.peer_id: "10.0.0.1:1", sybil.peer_id: "10.0.0.2:1"}
    answering = {"10.0.0.1:1": pb.InfoReply(peer_id=honest.peer_id, stage=0), "10.0.0.2:1": pb.InfoReply(stage=0)}

    async def discover(stage: int, include_pending: bool = False):
        return [
            types.SimpleNamespace(peer_id=i.peer_id, public_key=i.public_key, record=types.SimpleNamespace(address=a))
            for i, a in ((honest, records[honest.peer_id]), (sybil, records[sybil.peer_id]))
        ]

    class Stub:
        def __init__(self, address: str):
            self.address = address

        async def info(self, request, timeout):
            return answering[self.address]

    tickets = Tickets(types.SimpleNamespace(discover=discover, peer_id="us"), timeout=1.0, vet=True)
    tickets._channels = types.SimpleNamespace(stub=Stub, close=lambda: asyncio.sleep(0))  # type: ignore[assignment]
    with pytest.raises(TicketUnchecked, match="has not answered as itself"):  # the read starts both probes
        await tickets.check(meta_of(signed_by(sybil, "mb-s", 3, 3), "mb-s"), B, backward=True)
    assert not tickets.spent
    await asyncio.sleep(0.05)  # the probes came back
    await tickets.check(meta_of(signed_by(honest, "mb-h", 3, 3), "mb-h"), B, backward=True)
    with pytest.raises(TicketUnchecked):  # its address answers as someone else
        await tickets.check(meta_of(signed_by(sybil, "mb-s", 3, 3), "mb-s"), B, backward=True)
    assert len(tickets.spent) == 1
    await tickets.close()
