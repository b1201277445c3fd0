"""Who else serves this stage, and how far each of them is: the peers' `Progress` messages and the DHT.

After every backward, before its reply, a peer sends its sample count to every peer of its stage (the `Progress` RPC;
in a stage where it lists HUB_FROM other peers or more, to the epoch's hubs, which pass it on: hubs.py), so every
peer knows the exact total of the current epoch and a trainer that waits for its replies sees epochs end exactly at
the global batch. The DHT says who the peers are: a `Progress` message counts only if it is signed by the
key of a peer whose (signed) DHT record says it serves this stage; an authentic one from a peer we have not listed
yet makes us read the DHT before we answer (a peer that started or joined since our last read).

Owned by the event loop: only it writes. Other threads read copies (`ahead_of`, `counts_of`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import grpc

from dht.node import SwarmDHT
from server.collab import hubs, rules
from server.collab.hubs import Hub, Seen, hubs_for, is_hub, seal
from server.collab.tickets import ticket_key
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import PROTOCOL_VERSION, Channels
from swarm.tasks import cancelled_here

logger = logging.getLogger(__name__)
UNREACHABLE_HOLD_S = 30.0  # a peer a Progress could not reach stays out of the group this long unless it speaks
# ... and one we never heard from: 5 s after its first miss (a peer that is starting may not serve gRPC yet), twice
# that after each next one, up to 5 minutes (a record at an address nobody serves, which anyone can announce)
UNHEARD_HOLD_S = (5.0, 300.0)


class StagePeers:
    def __init__(self, sdht: SwarmDHT, stage: int, peer_timeout: float):
        self.sdht, self.stage, self.peer_timeout = sdht, stage, peer_timeout
        self.address = ""  # our own host:port, set by the server once gRPC is bound
        self.peers: dict[str, str] = {}  # the stage's other live peers: peer id -> gRPC address
        self.view: dict[str, tuple[int, int]] = {}  # their latest progress: peer id -> (epoch, samples)
        self.recovering: set[str] = set()  # peers whose latest progress says they are copying the stage's state
        self.lineages: dict[str, tuple[int, str]] = {}  # their parameters' lineage: peer id -> (epoch, lineage)
        self.averaged: dict[str, int] = {}  # the last epoch whose stage round ended for them: peer id -> epoch
        # peer id -> the latest epoch we refused to copy its state (not one honest step from ours: recovery.py)
        self._refused: dict[str, int] = {}
        self._counts: dict[int, dict[str, int]] = {}  # epoch -> peer id -> samples it reported for that epoch
        self._admitted: dict[int, dict[str, int]] = {}  # epoch -> peer id -> samples it admitted towards it
        self._first_epoch: dict[str, int] = {}  # peer id -> the epoch of its first message we received
        self._not_admitting: set[str] = set()  # stage 0 peers that said they admit no more Forwards
        self._claims: dict[str, int] = {}  # stage 0: peer id -> the latest epoch it claimed a share of (`claim`)
        self._claimed: dict[str, int] = {}  # stage 0: peer id -> the latest epoch our claim to it was answered
        self._missed_once: set[str] = set()  # known peers the last DHT read did not list
        # peers a Progress could not reach (dead or frozen: their DHT records outlive them by up to a record's
        # lifetime), until when: left out of the group even while the DHT lists them, until they speak again or
        # their hold (UNREACHABLE_HOLD_S, UNHEARD_HOLD_S) passes; `held` keeps the addresses the DHT lists for them
        self._unreachable: dict[str, float] = {}
        self._misses: dict[str, int] = {}  # peers we never heard from -> Progress messages in a row they missed
        self._answered: set[str] = set()  # peers that took a Progress of ours (with those we heard from: the group)
        # peers that ever took one at the address their record gives: one of them that speaks while held is a frozen
        # or cut-off peer come back; any other may be a record at an address nobody serves, whose owner speaks from
        # elsewhere (it stays held: speaking brought it back, each of our messages to it failed, ~3 a second)
        self._reached: set[str] = set()
        self.held: dict[str, str] = {}
        self._channels = Channels(sdht.p2p)
        self.p2p_ids: dict[str, str] = {}  # peer id -> libp2p id, from their records (state downloads address those)
        self.pending: dict[str, str] = {}  # peers the DHT lists as joining the stage: peer id -> gRPC address
        # peers whose work we verified: a round of ours that completed with them, a state of theirs we loaded.
        # Where a peer's word is trusted (rules.py `trusting`), only theirs is
        self.established: set[str] = set()
        # peer id -> (an epoch, the admissions of it that peer said it holds from us): left out of our next messages
        self._served_held: dict[str, tuple[int, frozenset[tuple]]] = {}
        self.bytes_sent = 0  # Progress messages, as serialized, times the peers each went to
        self.calls_sent = 0  # Progress calls made (a message to 3 peers: 3), those passing others' messages on aside
        self._latest: pb.StageProgress | None = None  # our latest message, as signed
        self.seen = Seen()  # the messages we took lately: one that comes again through another hub is skipped
        # what we pass on as one of the stage's hubs (hubs.py)
        self.hub = Hub(self._send, lambda: self.peers, self._envelope)
        self.messages_taken = 0  # Progress messages taken from stage peers (`record`)
        # the latest epoch stage 0's admissions show a peer can be at (None: any): a peer that reports more is left
        # out of what the queries below say of the peers' epochs (rules.py `shown`; any thread): the peers we
        # believe, at the epochs they report; and the latest epoch the word of an established peer (True) or of any
        # peer (False) may take it to (None: any)
        self.believed: Callable[[], dict[str, int]] | None = None
        self.shown_limit: Callable[[bool], int | None] = lambda trusted: None

    def unlisted(self, msg: pb.StageProgress) -> str | None:
        """Why the sender of an authentic `msg` does not count (yet), or None: the DHT lists it on this stage. A peer
        listed as still joining has joined by the time it reports (its ready record is on its way): it becomes a
        stage peer at the address its record gives."""
        if msg.peer_id in self.pending:
            self.peers[msg.peer_id] = self.pending.pop(msg.peer_id)
        if msg.peer_id in self.held and msg.peer_id in self._reached:  # it speaks again: frozen, or its link was down
            logger.info("stage peer %s answers again; back in the group", self.held[msg.peer_id])
            self.peers[msg.peer_id] = self.held.pop(msg.peer_id)
            self._unreachable.pop(msg.peer_id, None)
        if msg.peer_id in self.held:
            return f"progress: {msg.peer_id}'s address on stage {self.stage} ({self.held[msg.peer_id]}) did not answer"
        if msg.peer_id not in self.peers:
            return f"progress: {msg.peer_id} is not listed on stage {self.stage} (yet)"
        return None

    def took(self, peer_id: str) -> None:
        """A listed peer took a Progress of ours: it serves where its record says (it may join our rounds)."""
        if peer_id in self.peers:
            self._answered.add(peer_id)
            self._reached.add(peer_id)
            self._misses.pop(peer_id, None)

    def heard_from(self, peer_id: str) -> bool:
        return peer_id in self._first_epoch

    def record(self, msg: pb.StageProgress) -> None:
        """A stage peer's count (passed `check`). Messages can arrive out of order (each is its own RPC): a peer's
        progress only moves forward."""
        self.messages_taken += 1
        self.seen.add(msg)
        progress = (int(msg.epoch), int(msg.samples))
        if progress >= self.view.get(msg.peer_id, progress):
            self.view[msg.peer_id] = progress
            if msg.lineage:
                self.lineages[msg.peer_id] = int(msg.epoch), msg.lineage
            if msg.recovering:
                self.recovering.add(msg.peer_id)
            else:
                self.recovering.discard(msg.peer_id)
        if msg.HasField("averaged"):
            self.averaged[msg.peer_id] = max(self.averaged.get(msg.peer_id, -1), int(msg.averaged))
        if msg.stopped_admitting:
            self._not_admitting.add(msg.peer_id)
        elif msg.claims:
            self._claims[msg.peer_id] = max(self._claims.get(msg.peer_id, -1), int(msg.epoch))
        self._first_epoch.setdefault(msg.peer_id, int(msg.epoch))
        counts = self._counts.setdefault(int(msg.epoch), {})
        counts[msg.peer_id] = max(counts.get(msg.peer_id, 0), int(msg.samples))
        self._note_admitted(msg.peer_id, int(msg.epoch), int(msg.admitted), int(msg.admitted_next))

    def _note_admitted(self, peer_id: str, epoch: int, admitted: int, admitted_next: int) -> None:
        """What `peer_id` said it admitted towards `epoch` and the next one; counts only grow."""
        for e, n in ((epoch, admitted), (epoch + 1, admitted_next)):
            known = self._admitted.setdefault(e, {})
            known[peer_id] = max(known.get(peer_id, 0), n)

    async def refresh(self) -> None:
        """The stage's peers as the DHT lists them. A peer we know that one read misses stays until a second read
        misses it too: under load a record can be briefly absent, and forgetting a live peer (and the samples it
        reported) stalls the stage until that peer next reports, which it does only after the epoch it waits for."""
        entries = [
            e for e in await self.sdht.discover(self.stage, include_pending=True) if e.peer_id != self.sdht.peer_id
        ]
        listed = {e.peer_id: e.record.address for e in entries if e.record.ready}
        now = time.monotonic()
        self._unreachable = {p: until for p, until in self._unreachable.items() if now < until}
        self.held = {p: a for p, a in listed.items() if p in self._unreachable}
        listed = {p: a for p, a in listed.items() if p not in self._unreachable}
        self.pending = {e.peer_id: e.record.address for e in entries if not e.record.ready}
        self.p2p_ids.update({e.peer_id: e.record.p2p_id for e in entries})
        missed = {p: a for p, a in self.peers.items() if p not in listed and p not in self._missed_once}
        self._missed_once = set(missed)
        self.peers = {**missed, **listed}
        self.view = {p: v for p, v in self.view.items() if p in self.peers}
        self.lineages = {p: v for p, v in self.lineages.items() if p in self.peers}
        self.averaged = {p: e for p, e in self.averaged.items() if p in self.peers}
        self.recovering &= set(self.peers)
        self._answered &= set(self.peers)
        self._misses = {p: n for p, n in self._misses.items() if p in listed or p in self._unreachable}
        self._reached &= set(self.peers) | set(self.held)

    async def broadcast(
        self,
        epoch: int,
        samples: int,
        end_epoch: bool,
        admitted: tuple[int, int] = (0, 0),
        stopped_admitting: bool = False,
        claims: bool = False,
        lineage: str = "",
        averaged: int | None = None,
        recovering: bool = False,
        served: Sequence[pb.Admission] = (),
        taken: tuple[int | None, Sequence[pb.Admission]] = (None, ()),
        moved_on: pb.Admission | None = None,
        via_hubs: bool = False,
    ) -> dict[str, pb.ProgressAck]:
        """Our progress to every stage peer. Returns the answers of those that took it, by peer id. `averaged`: the
        last epoch whose stage round ended for us (None: none yet). `recovering`: we are copying a state. `served`:
        stage 0's admissions of the microbatches behind our count (served.py), of which the message carries those
        some peer has not said it holds; `taken`: an earlier epoch whose round we are in (delayed steps), and the
        admissions behind our weight in it; `moved_on`: stage 0's admission of a later epoch than `epoch`.
        `via_hubs`: in a stage of HUB_FROM other peers or more, to `epoch`'s hubs alone, which pass it on (hubs.py)."""
        peers = list(self.peers.items())
        via_hubs = via_hubs and len(peers) >= hubs.HUB_FROM and not claims
        chosen = hubs_for(epoch, [*self.peers, self.sdht.peer_id]) if via_hubs else []
        if via_hubs:
            peers = [(p, self.peers[p]) for p in chosen if p in self.peers]
        keys = [ticket_key(a) for a in served]
        held = {peer_id: self._held_by(peer_id, epoch) for peer_id, _ in peers}
        lacking = {k for k in keys if any(k not in h for h in held.values())}
        served = [a for a, k in zip(served, keys, strict=True) if k in lacking]
        msg = pb.StageProgress(
            protocol_version=PROTOCOL_VERSION,
            stage=self.stage,
            peer_id=self.sdht.peer_id,
            epoch=epoch,
            samples=samples,
            end_epoch=end_epoch,
            address=self.address,
            admitted=admitted[0],
            admitted_next=admitted[1],
            stopped_admitting=stopped_admitting,
            public_key=self.sdht.identity.public_key,
            claims=claims,
            lineage=lineage,
            averaged=averaged,
            recovering=recovering,
            served=served,
            taken_epoch=taken[0],
            taken=taken[1],
            moved_on=moved_on,
            via_hub=via_hubs,
        )
        msg.signature = self.sdht.identity.sign(msg.SerializeToString())
        self._latest = msg
        if self.sdht.peer_id in chosen:
            self.hub.add(msg, urgent=end_epoch)
        self.bytes_sent += msg.ByteSize() * len(peers)
        self.calls_sent += len(peers)
        acks = await asyncio.gather(*(self._send(peer_id, address, msg) for peer_id, address in peers))
        answered = {peer_id: ack for (peer_id, _), ack in zip(peers, acks, strict=True) if ack is not None}
        for peer_id in answered:
            self.took(peer_id)
        for peer_id, ack in answered.items():
            sent = held[peer_id] | lacking
            if ack.served_held < len(sent):  # it holds fewer than we sent it (it restarted, or could not check some
                self._served_held.pop(peer_id, None)  # signers yet): the next message carries them all
            elif sent:  # (a claim of the next epoch carries none: it leaves what this epoch's messages left out)
                self._served_held[peer_id] = epoch, sent | self._held_by(peer_id, epoch)
        for gone in set(self._served_held) - set(self.peers):
            del self._served_held[gone]
        return answered

    def is_hub(self, epoch: int) -> bool:
        return is_hub(epoch, self.sdht.peer_id, self.peers)

    def _envelope(self, passed_on: list[pb.StageProgress]) -> pb.StageProgress | None:
        """Our latest progress carrying `passed_on` (hubs.py `seal`); None before our first message."""
        return None if self._latest is None else seal(self._latest, passed_on, self.sdht.identity.sign)

    def _held_by(self, peer_id: str, epoch: int) -> frozenset[tuple]:
        """The admissions of `epoch` that `peer_id` said it holds from us."""
        held_epoch, keys = self._served_held.get(peer_id, (None, frozenset()))
        return keys if held_epoch == epoch else frozenset()

    async def _send(self, peer_id: str, address: str, msg: pb.StageProgress) -> pb.ProgressAck | None:
        try:
            return await self._channels.stub(address).progress(msg, timeout=self.peer_timeout)
        except grpc.aio.AioRpcError as e:
            self._failed(peer_id, address, e)
            return None
        except asyncio.CancelledError:
            if cancelled_here():
                raise
            return None  # the call was cancelled, not we (its channel closed): the peer did not take it

    async def probe(self, peer_id: str) -> bool:
        """Whether a live peer of the stage answers an Info call within the peer timeout. One that does not is dropped
        as a Progress it does not take drops it: a peer waiting for it (to copy its state after a failed round)
        learns within seconds that it froze, instead of when some Progress next goes its way."""
        address = self.peers.get(peer_id)
        if address is None:
            return False
        try:
            await self._channels.stub(address).info(pb.InfoRequest(), timeout=self.peer_timeout)
            return True
        except grpc.aio.AioRpcError as e:
            return not self._failed(peer_id, address, e)

    async def state_of(self, peer_id: str, timeout: float) -> tuple[int, str] | None:
        """(epoch, state digest) a live peer of the stage answers Info with; None if it does not (in `timeout`
        seconds: it fingerprints its whole state first), shares no state now, or if the server at its address is
        another peer or serves another stage (it moved, and its record has not expired yet)."""
        address = self.peers.get(peer_id)
        if address is None:
            return None
        try:
            reply = await self._channels.stub(address).info(pb.InfoRequest(with_digest=True), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            logger.debug("stage peer %s did not tell its state: %s", address, e.code().name)
            return None
        except asyncio.CancelledError:
            if cancelled_here():
                raise
            return None  # its channel closed under the call
        if reply.peer_id != peer_id or reply.stage != self.stage or not reply.state_digest:
            return None
        return reply.epoch, reply.state_digest

    def _failed(self, peer_id: str, address: str, e: grpc.aio.AioRpcError) -> bool:
        """A call to a stage peer failed: a dead or frozen peer is dropped (True), until the DHT lists it again."""
        if e.code() == grpc.StatusCode.PERMISSION_DENIED:  # alive, and has not read our record yet
            logger.debug("stage peer %s does not list us yet", address)
            return False
        if peer_id not in self.peers:  # another message's failure dropped it already
            return True
        logger.info("stage peer %s unreachable (%s); dropping it from the group", address, e.code().name)
        if self.heard_from(peer_id):
            self._drop(peer_id, address, UNREACHABLE_HOLD_S)
        else:
            misses = self._misses[peer_id] = self._misses.get(peer_id, 0) + 1
            first, most = UNHEARD_HOLD_S
            self._drop(peer_id, address, min(most, first * 2 ** min(misses - 1, 16)))
        return True

    def _drop(self, peer_id: str, address: str, hold: float | None) -> None:
        """Leave a peer out of the group; `hold`: for that many seconds even while the DHT lists it, unless it speaks
        again."""
        if self.peers.pop(peer_id, None) is not None and hold is not None:
            self._unreachable[peer_id] = time.monotonic() + hold
            self.held[peer_id] = address
        self._answered.discard(peer_id)
        self.view.pop(peer_id, None)
        self._served_held.pop(peer_id, None)  # back, it may have restarted: it gets every admission again
        self._channels.drop(address)

    def must_claim(self, epoch: int) -> bool:
        """Stage 0, before admitting towards `epoch`: whether some peer may not count us among the admitting peers
        (`admitting`): only a peer that answered our claim of `epoch` or the one before surely does."""
        return any(self._claimed.get(p, -2) < epoch - 1 for p in self.peers)

    async def claim(
        self, epoch: int, samples: int, admitted: tuple[int, int], most: int, served: Sequence[pb.Admission] = ()
    ) -> bool:
        """Stage 0: ask every peer to count us among the admitting peers of `epoch` and the next one, and learn what
        each had admitted towards them when it did. Returns whether every peer we count answered (one the DHT listed
        meanwhile has not been asked yet): one that does not count us may admit the whole batch. A peer that refuses
        the claim although it read the DHT for it (intake.py `on_progress`), or answers a count below 0 or above
        `most` (what one epoch can hold, the bound its Progress messages have too), is left out of the group like an
        unreachable one: else a single hostile peer would keep every other peer from admitting. `served`: the
        admissions behind `samples` (a claim's count ends an epoch as a Progress's does, and must weigh as much in
        its round)."""
        asked = dict(self.peers)
        acks = await self.broadcast(epoch, samples, False, admitted, claims=True, served=served)
        for peer_id, address in asked.items():
            if peer_id not in self.peers:  # unreachable: already dropped
                continue
            ack = acks.get(peer_id)
            if ack is None or not (0 <= ack.admitted <= most and 0 <= ack.admitted_next <= most):
                logger.info(
                    "stage peer %s refused our claim of global batch %d; dropping it from the group", address, epoch
                )
                self._drop(peer_id, address, UNREACHABLE_HOLD_S)
                continue
            self._note_admitted(peer_id, epoch, int(ack.admitted), int(ack.admitted_next))
            self._claimed[peer_id] = max(self._claimed.get(peer_id, -2), epoch)
        return not self.must_claim(epoch)

    # --- queries (any thread: they copy what the event loop updates) -----------------------------------------------

    def _shown(self) -> dict[str, tuple[int, int]]:
        """`view`, less the peers whose epoch stage 0's admissions do not show possible (`believed`)."""
        view = dict(self.view)
        if self.believed is None:
            return view
        believed = self.believed()
        return {p: v for p, v in view.items() if believed.get(p) == v[0]}

    def samples_in(self, epoch: int) -> int:
        """Samples the other peers reported for `epoch`, as they stand in their latest messages."""
        return sum(s for e, s in dict(self.view).values() if e == epoch)

    def ahead_of(self, epoch: int) -> list[str]:
        """Stage peers that have finished `epoch`, by peer id."""
        return sorted(p for p, (e, _) in self._shown().items() if e > epoch)

    def all_ahead_of(self, epoch: int) -> bool:
        return set(self.peers) <= set(self.ahead_of(epoch))

    def round_over(self, epoch: int, delayed: bool) -> bool:
        """Whether the stage round of `epoch` is over for every live peer. With synchronous steps their reports of a
        later epoch say so. With delayed steps they report the next epoch while the round runs: their `averaged`
        epoch says so, or a report two epochs on (a peer ends the next epoch only once this round is over for it, and
        one that stepped alone while we were frozen reports no round of those epochs at all)."""
        if not delayed:
            return self.all_ahead_of(epoch)
        view = self._shown()
        averaged = self._shown_averaged(view)
        return all(averaged.get(p, -1) >= epoch or view.get(p, (-1, 0))[0] >= epoch + 2 for p in self.peers)

    def _shown_averaged(self, shown: dict[str, tuple[int, int]]) -> dict[str, int]:
        """`averaged`, of the peers `shown` (`_shown`) keeps: a peer left out says nothing of its rounds either."""
        return {p: e for p, e in dict(self.averaged).items() if p in shown}

    def averaged_since(self, epoch: int) -> list[str]:
        """Live peers whose stage round of `epoch`, or of a later epoch, ended."""
        live = set(self.peers)
        return sorted(p for p, e in self._shown_averaged(self._shown()).items() if e >= epoch and p in live)

    def group_size(self, epoch: int) -> int:
        """Us and every listed peer that took a Progress of ours or sent us one (a record is a claim: anyone can
        announce one at an address nobody serves, and a round waiting for such a peer fails), or that reported `epoch`,
        except those that reported an epoch before `epoch - 1` or that say they are copying a state: such a peer
        copies a state instead of joining the round, and counted in it, it would hold the round until
        --averaging-timeout (with delayed steps we share no state until our round ends)."""
        return 1 + len(self.group(epoch))

    def group(self, epoch: int) -> set[str]:
        """The peers `group_size` counts, us aside."""
        view = dict(self.view)
        behind = {p for p, (e, _) in view.items() if e < epoch - 1} | self.recovering
        known = {p for p in self.peers if p in self._answered or self.heard_from(p)}
        return (known - behind) | {p for p, (e, _) in view.items() if e == epoch and p not in behind}

    def group_p2p_ids(self, epoch: int) -> list[str] | None:
        """The libp2p ids of the peers `group_size` counts (us aside), or None if a record has not told us one."""
        p2p_ids = dict(self.p2p_ids)
        ids = [p2p_ids.get(p, "") for p in self.group(epoch)]
        return ids if all(ids) else None

    def counts_of(self, epoch: int) -> dict[str, int]:
        """Samples each live peer reported for `epoch` (the largest count each sent)."""
        live = set(self.peers)
        return {p: n for p, n in dict(self._counts.get(epoch, {})).items() if p in live}

    def admitted_by(self, peer_id: str, epoch: int) -> int:
        """Samples `peer_id` admitted towards `epoch` (stage 0), as far as its messages told."""
        return self._admitted.get(epoch, {}).get(peer_id, 0)

    def admitting(self, epoch: int) -> list[str]:
        """Live peers that admit Forwards (stage 0): those that did towards `epoch` or the one before, that claimed a
        share of either, and those we have known for less than an epoch. A peer that trainers stopped sending work to
        drops out after an epoch."""
        return [
            p
            for p in self.peers
            if p not in self._not_admitting
            and (
                self.admitted_by(p, epoch)
                or self.admitted_by(p, epoch - 1)
                or self._claims.get(p, -2) >= epoch - 1
                or self._first_epoch.get(p, epoch) >= epoch - 1
            )
        ]

    def refuse(self, peer_id: str, epoch: int) -> None:
        """We refused to copy `peer_id`'s state in `epoch`: see `distrusted`."""
        self._refused[peer_id] = max(epoch, self._refused.get(peer_id, epoch))

    def distrusted(self, epoch: int) -> set[str]:
        """Peers whose state we refused lately, at `epoch` (rules.py `distrusted`)."""
        return rules.distrusted(dict(self._refused), epoch)

    def establish(self, p2p_ids: frozenset[str]) -> None:
        """Event loop: the peers of these libp2p ids completed a round with us."""
        self.established.update(p for p, p2p in dict(self.p2p_ids).items() if p2p in p2p_ids)

    def refused_at(self) -> dict[str, int]:
        """Any thread: peer id -> the latest epoch we refused its state."""
        return dict(self._refused)

    def lineage_reference(self, epoch: int, lineage: str, moved_on: bool = False) -> str | None:
        """The peer whose state we copy once it has stepped past `epoch`, because the peers at `epoch` hold more than one
        lineage (some stepped alone, not knowing of the others): the smallest peer id of the lineage most of the peers
        at `epoch` hold, us included (ties: the lineage of the smallest peer id), unless that lineage is ours. Peers
        that see the same lineages name the same reference, and the fewest peers copy. A copy takes the reference's
        word (its history is not ours to check), so the majority is what keeps one peer that announces a lineage of
        its own, with a peer id ground to be the smallest, from handing every peer of the stage parameters of its
        choice: it can only win a tie, where every honest peer stepped alone. `moved_on`: peers that already report
        the next epoch count too (delayed steps: a peer reports it as soon as it takes its gradients)."""
        epochs = (epoch, epoch + 1) if moved_on else (epoch,)
        distrusted = self.distrusted(epoch)
        same = {
            p: line
            for p, (e, line) in dict(self.lineages).items()
            if e in epochs and p in self.peers and p not in distrusted
        }
        holders: dict[str, list[str]] = {lineage: [self.sdht.peer_id]}
        for p, line in same.items():
            holders.setdefault(line, []).append(p)
        most = min(holders, key=lambda line: (-len(holders[line]), min(holders[line])))
        return None if most == lineage else min(holders[most])

    def members(self) -> list[str]:
        """The libp2p ids of every peer the DHT lists, or listed, on this stage (signed records): the only peers our
        all-reduce groups may hold."""
        return list(dict(self.p2p_ids).values())

    def epochs_of(self) -> dict[str, int]:
        return {p: e for p, (e, _) in self._shown().items()}

    def forget_before(self, epoch: int) -> None:
        """Event loop: counts of epochs before `epoch` are no longer needed."""
        for old in [e for e in self._counts if e < epoch]:
            del self._counts[old]
        for old in [e for e in self._admitted if e < epoch]:
            del self._admitted[old]

    async def close(self) -> None:
        await self.hub.close()
        await self._channels.close()
