"""Stage 0's admissions, signed, so that no caller can forge where a microbatch belongs.

Stage 0 decides which global batch a microbatch joins (admission.py); every later call of the microbatch carries
that decision (`CallMeta.global_batch`, `admitted_at`) and stages act on it: a call admitted at a later epoch ends
the stage's current epoch (epoch.py `observe`), and a Backward's gradient goes to the batch it names. Trainers relay
the tag, and anyone can call a stage, so the admitting peer signs the tag, bound to the microbatch's id and sample
count, with the key its DHT record is signed with (dht/identity.py). A stage acts on a tag only if the signer is a
peer the DHT lists (or listed) on stage 0; a Backward without one is refused, since every training microbatch passes
stage 0's admission first. A ticket pays for one Backward on each server: replayed, it would add its gradient again
and again, and a stage's step would absorb many times its global batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from dht.identity import verify
from dht.node import SwarmDHT
from dht.reads import ThrottledRead
from server.collab import rules
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import PROTOCOL_VERSION, Channels
from swarm.vetting import Vetting, answers_as

logger = logging.getLogger(__name__)
MAX_SIGNERS = 1024  # stage-0 keys remembered (a peer that left: its microbatches in flight still verify)
MAX_SPENT = 1 << 16  # tickets remembered as spent (a global batch of 1024 microbatches, 64 times over)
READ_INTERVAL_S = 0.25  # the most often tickets from an unknown signer make us read stage 0's records
PROBE_S = 5.0  # a stage-0 signer's server answers its Info within this


@dataclass(frozen=True)
class Ticket:
    """Stage 0's admission of a microbatch: the global batch it joins, stage 0's epoch then, and who signed it with
    what ("" and b"" where nobody needs to check: a stage without peers)."""

    global_batch: int
    admitted_at: int
    signer: str = ""
    signature: bytes = b""


class TicketRefused(Exception):
    """A call whose admission is missing, unsigned, or not signed by a stage-0 peer: PERMISSION_DENIED, nothing
    computed."""


class TicketUnchecked(Exception):
    """A call signed by a key we do not know, and our DHT read of stage 0's records did not complete (a DHT node that
    does not answer): we cannot tell a forgery from a stage-0 peer we have not heard of. UNAVAILABLE ("behind: ..."),
    nothing computed; the caller asks again, here or elsewhere, without counting it against us."""


class TicketSpent(TicketRefused):
    """A Backward whose ticket a Backward here has used already: its gradient is counted. A retry after a reply that
    was lost gets that reply again if the server still has it (server/replies.py), else PERMISSION_DENIED."""


def ticket_key(meta: pb.CallMeta | pb.Admission) -> tuple[str, str, int, int]:
    """What identifies one admission of one microbatch (as a call carries it, or a Progress: served.py)."""
    return meta.admitted_by, meta.microbatch_id, meta.global_batch, meta.admitted_at


def admission_of(meta: pb.CallMeta, samples: int) -> pb.Admission:
    """A call's admission of its microbatch of `samples`, as a Progress carries it (server/collab/served.py)."""
    return pb.Admission(
        microbatch_id=meta.microbatch_id,
        samples=samples,
        global_batch=meta.global_batch,
        admitted_at=meta.admitted_at,
        admitted_by=meta.admitted_by,
        signature=meta.admission_signature,
    )


def by_signer(admissions: Iterable[pb.Admission]) -> dict[str, int]:
    """Samples of `admissions` by the stage-0 peer that signed each."""
    work: dict[str, int] = {}
    for a in admissions:
        work[a.admitted_by] = work.get(a.admitted_by, 0) + int(a.samples)
    return work


def ticket_bytes(microbatch_id: str, samples: int, global_batch: int, admitted_at: int) -> bytes:
    """What stage 0 signs: its admission of one microbatch."""
    return f"swarm-admission/v{PROTOCOL_VERSION}\0{microbatch_id}\0{samples}\0{global_batch}\0{admitted_at}".encode()


def _check_form(meta: pb.CallMeta, backward: bool) -> bool:
    """-> whether `meta` carries an admission; raises TicketRefused for a Backward without one or one malformed."""
    if not (meta.HasField("global_batch") or meta.HasField("admitted_at")):
        if backward:
            raise TicketRefused("a Backward needs stage 0's admission of its microbatch (CallMeta.global_batch)")
        return False
    if not (meta.HasField("global_batch") and meta.HasField("admitted_at")):
        raise TicketRefused("admission: global_batch and admitted_at come together")
    if not meta.admitted_by or not meta.admission_signature:
        raise TicketRefused("admission: not signed (CallMeta.admitted_by, admission_signature)")
    return True


class Tickets:
    """Signs this peer's admissions (stage 0) and checks the tags of calls against stage 0's keys. Event loop."""

    def __init__(self, sdht: SwarmDHT, timeout: float, vet: bool = False):
        """`vet`: a signer counts only once its server answered as it (stages past 0; stage 0 checks no other
        stage-0 peer's admission in a call)."""
        self.sdht, self.vet = sdht, vet
        self.signers: OrderedDict[str, bytes] = OrderedDict()  # stage-0 peer id -> its public key
        self._read = ThrottledRead(self._refresh, READ_INTERVAL_S, timeout)
        self.spent: OrderedDict[tuple, None] = OrderedDict()  # tickets a Backward here has used
        self.refused = 0
        # the verified admission signed at the latest epoch of stage 0 (a call's, or a Progress's: served.py): the
        # proof that stage 0 has finished every epoch before its `admitted_at` (epoch.py `_may_end`)
        self.latest: pb.Admission | None = None
        self.shown: dict[str, int] = {}  # stage-0 signer -> the latest `admitted_at` verified from it
        # past stage 0, a signer counts once the server at its record's address answered Info as it, on stage 0
        # (swarm/vetting.py): anyone may list a record, and a signed stage-0 record at an address nobody serves had its
        # admissions' microbatches computed and accumulated here, steps of more samples than stage 0 admitted
        self.vetting = Vetting()
        self.addresses: dict[str, str] = {}  # stage-0 signer -> its record's address, at our last read
        self._channels: Channels | None = None  # opened by the first probe
        self._probes: dict[str, asyncio.Task] = {}  # signer -> its probe in flight

    @property
    def latest_at(self) -> int:
        """The latest epoch of stage 0 any verified admission shows (-1: none seen), whoever signed it."""
        return -1 if self.latest is None else int(self.latest.admitted_at)

    def stage0_at(self, work: dict[str, int]) -> int:
        """The latest epoch of stage 0 that signers holding at least half of `work` show (rules.py `frontier`)."""
        return rules.frontier(self.shown, work)

    def verified(self, admission: pb.Admission) -> bool | None:
        """Whether the stage-0 peer `admission` names signed it, as a call or a Progress carries it (None: a signer
        we do not know)."""
        key = self.signers.get(admission.admitted_by)
        if key is None:
            return None
        a = admission
        return verify(key, ticket_bytes(a.microbatch_id, a.samples, a.global_batch, a.admitted_at), a.signature)

    def witness(self, admission: pb.Admission) -> None:
        """`admission` verified against a stage-0 key: keep it if it shows stage 0 at a later epoch than we knew."""
        signer, at = admission.admitted_by, int(admission.admitted_at)
        if signer in self.signers and at > self.shown.get(signer, -1):
            self.shown[signer] = at
        if at > self.latest_at:
            self.latest = admission

    def sign(self, microbatch_id: str, samples: int, global_batch: int, admitted_at: int) -> tuple[str, bytes]:
        """Stage 0: (our peer id, our signature) of an admission."""
        self._remember(self.sdht.peer_id, self.sdht.identity.public_key)
        signed = ticket_bytes(microbatch_id, samples, global_batch, admitted_at)
        return self.sdht.peer_id, self.sdht.identity.sign(signed)

    async def check(self, meta: pb.CallMeta, samples: int, backward: bool) -> None:
        """Raises TicketRefused unless `meta`'s admission is signed by a stage-0 peer for this microbatch id and
        `samples`, or the call has no admission and is not a Backward (evaluation)."""
        with self._counting():
            await self._check(meta, samples, backward)

    def precheck(self, meta: pb.CallMeta, backward: bool) -> None:
        """What `check` refuses from `meta` alone (raises TicketRefused): run on a call's first frame, so that such a
        call is turned away before its payload is read."""
        with self._counting():
            _check_form(meta, backward)

    @contextlib.contextmanager
    def _counting(self) -> Iterator[None]:
        try:
            yield
        except TicketRefused:
            self.refused += 1
            raise

    async def _check(self, meta: pb.CallMeta, samples: int, backward: bool) -> None:
        if not _check_form(meta, backward):
            return
        key = self.signers.get(meta.admitted_by)
        read = True
        if key is None:
            read = await self.read_signers()
            key = self.signers.get(meta.admitted_by)
        if key is None and not read:
            raise TicketUnchecked("behind: cannot check this admission's signer yet (our DHT read of stage 0 failed)")
        if key is None:
            raise TicketRefused(
                f"admission: signed by {meta.admitted_by[:40]!r}, which the DHT does not list on stage 0"
            )
        admission = admission_of(meta, samples)
        if not self.verified(admission):
            raise TicketRefused("admission: the signature does not match this microbatch, its samples or its batch")
        if not await self.vetted(meta.admitted_by):
            raise TicketUnchecked(
                f"behind: stage-0 signer {meta.admitted_by[-6:]} has not answered as itself at its record's address yet"
            )
        self.witness(admission)
        if backward:
            ticket = ticket_key(meta)
            if ticket in self.spent:
                raise TicketSpent("admission: spent; this microbatch's Backward was counted here already")
            self.spent[ticket] = None
            while len(self.spent) > MAX_SPENT:
                self.spent.popitem(last=False)

    def forget(self, meta: pb.CallMeta) -> None:
        """A Backward whose ticket `check` took failed before its gradient was accumulated: it may come again."""
        self.spent.pop(ticket_key(meta), None)

    async def read_signers(self) -> bool:
        """Read stage 0's records (at most every READ_INTERVAL_S; concurrent callers share a read): the keys of its
        peers. False if the read did not complete."""
        return await self._read()

    async def read_signers_since(self, since: float, timeout: float) -> None:
        """Wait up to `timeout` seconds for a read of stage 0's records begun at monotonic time `since` or later: one
        that may list a stage-0 peer that joined since our last read (`ThrottledRead.since`)."""
        await self._read.since(since, timeout)

    async def vetted(self, signer: str) -> bool:
        """Whether `signer`'s admissions count here: it is us, or its server answered as it. A signer being probed
        (just listed: a new stage-0 peer) is waited for, up to PROBE_S; one whose probe failed is not, until its next
        probe is due (swarm/vetting.py)."""
        if not self.vet or signer == self.sdht.peer_id or self.vetting.vetted(signer):
            return True
        self._probe_due()
        probe = self._probes.get(signer)
        if probe is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(probe), PROBE_S)
        return self.vetting.vetted(signer)

    def _probe_due(self) -> None:
        for peer_id in self.vetting.listed(self.addresses):
            task = asyncio.ensure_future(self._probe(peer_id, self.addresses[peer_id]))
            self._probes[peer_id] = task  # asyncio keeps only weak references to tasks
            task.add_done_callback(functools.partial(self._probe_done, peer_id))

    def _probe_done(self, peer_id: str, task: asyncio.Task) -> None:
        if self._probes.get(peer_id) is task:
            del self._probes[peer_id]

    async def _probe(self, peer_id: str, address: str) -> None:
        if self._channels is None:
            self._channels = Channels(self.sdht.p2p)
        self.vetting.answered(peer_id, address, await answers_as(self._channels, address, peer_id, 0, PROBE_S))

    async def close(self) -> None:
        probes = list(self._probes.values())
        for task in probes:
            task.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        if self._channels is not None:
            await self._channels.close()

    async def _refresh(self) -> None:
        entries = await self.sdht.discover(0, include_pending=True)
        for entry in entries:
            self._remember(entry.peer_id, entry.public_key)
        if self.vet:
            # a signer that left stays vetted while we remember its key: its microbatches in flight still count
            self.addresses.update({e.peer_id: e.record.address for e in entries})
            self.addresses = {p: a for p, a in self.addresses.items() if p in self.signers}
            self._probe_due()  # a new stage-0 peer is vetted before its first admission reaches us

    def _remember(self, peer_id: str, public_key: bytes) -> None:
        self.signers[peer_id] = public_key
        self.signers.move_to_end(peer_id)
        while len(self.signers) > MAX_SIGNERS:
            gone, _ = self.signers.popitem(last=False)
            self.shown.pop(gone, None)
