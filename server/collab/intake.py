"""A stage peer's Progress, taken: checked, its admissions proved, recorded, and acted on.

Every message counts as if its sender had sent it to us, whether it came directly or passed on by a hub (hubs.py):
it must be signed by the peer it names (server/schema.py `forged_progress`), from a peer the DHT lists on this stage
(an authentic one from a peer we have not listed yet waits for a DHT read, shared by concurrent messages, at most
four a second), with counts one epoch can hold, and with the admissions behind its count proved (served.py). Then
the stage's view moves on (progress.py `record`), and the epoch protocol is told: a first message from a peer gets
our count back, an `end_epoch` may end our epoch (rules.py `on_end_message`), and the poller and stage 0's gate look
again.

Owned by the event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from server.collab.gate import Gate
from server.collab.progress import StagePeers
from server.collab.served import ForgedAdmission, Served
from server.collab.tickets import ticket_key
from server.schema import forged_progress
from server.worker import StageWorker
from swarm.protocol import wire_pb2 as pb

logger = logging.getLogger(__name__)


class ProgressRefused(Exception):
    """A Progress message that must not count: unsigned, from a peer the DHT does not list on this stage, or
    implausible. The sender gets PERMISSION_DENIED."""


class Intake:
    def __init__(
        self,
        worker: StageWorker,
        peers: StagePeers,
        served: Served,
        gate: Gate,
        stage: int,
        peer_id: str,
        most_samples: int,
        *,
        lookup: Callable[[], Awaitable[object]],
        greet: Callable[[], None],
        ended: Callable[[int, str], None],
        kick: Callable[[], None],
        phase: Callable[[], str],
    ):
        """`lookup()`: a throttled DHT read of the stage; `greet()`: our count to the stage (a peer that just started
        waits for it); `ended(epoch, sender)`: `sender` asks us to end `epoch`; `kick()`: the poller looks again;
        `phase()`: ours, for the log."""
        self.worker, self.peers, self.served, self.gate = worker, peers, served, gate
        self.stage, self.peer_id, self.most_samples = stage, peer_id, most_samples
        self.lookup, self.greet, self.ended, self.kick, self.phase = lookup, greet, ended, kick, phase

    async def on_progress(self, msg: pb.StageProgress) -> pb.ProgressAck:
        """A stage peer's count (fields validated by the service). Raises ProgressRefused for a message that must not
        count. The messages a hub passes on in it (`passed_on`) are taken one by one as if their senders had sent
        them, those we took already aside; one refused is left out. One sent to us as a hub of its epoch we pass on
        (hubs.py)."""
        ack = await self._take(msg)
        if msg.via_hub and self.peers.is_hub(int(msg.epoch)):
            self.peers.hub.add(msg, urgent=msg.end_epoch, current=self.worker.epoch)
        for passed in msg.passed_on:
            if passed.peer_id == self.peer_id or self.peers.seen(passed):
                continue
            try:
                await self._take(passed)
            except ProgressRefused as e:
                logger.debug("progress passed on by %s refused: %s", msg.peer_id[-6:], e)
        return ack

    async def _take(self, msg: pb.StageProgress) -> pb.ProgressAck:
        reason = forged_progress(msg)
        if reason is None and msg.peer_id not in self.peers.held and self.peers.unlisted(msg):
            await self.lookup()  # not for a held peer: listed, and a stranger's messages must not drive our reads
        reason = reason or self.peers.unlisted(msg)
        if reason is not None:
            raise ProgressRefused(reason)
        first = not self.peers.heard_from(msg.peer_id)
        counts = (msg.samples, msg.admitted, msg.admitted_next, len(msg.served), len(msg.taken))
        if max(counts) > (most := self.most_samples):
            raise ProgressRefused(f"progress: a count above {most} samples, more than one epoch can hold")
        try:
            await self.served.prove(msg, self.worker.epoch)
        except ForgedAdmission as e:
            raise ProgressRefused(str(e)) from None
        if self.stage == 0:  # ours that a peer computed came back (proved: their signature is ours)
            now = time.monotonic()
            for a in (*msg.served, *msg.taken):
                if a.admitted_by == self.peer_id:
                    self.gate.leases.returned(ticket_key(a), now)
        self.peers.record(msg)
        if first:  # a peer that just started: it waits for our count before it admits (gate.py)
            self.greet()
        logger.debug(
            "progress from %s: epoch %d, %d samples%s (we are at %d, %s)",
            msg.peer_id[-6:],
            msg.epoch,
            msg.samples,
            ", end of epoch" if msg.end_epoch else "",
            self.worker.epoch,
            self.phase(),
        )
        if msg.end_epoch:
            self.ended(int(msg.epoch), msg.peer_id)
        self.kick()
        self.gate.wake()
        held = self.served.held(msg.peer_id, int(msg.epoch))
        if not msg.claims:
            return pb.ProgressAck(epoch=self.worker.epoch, served_held=held)
        # from here on we count the claimant's share
        admitted, admitted_next = self.gate.admission.counts(int(msg.epoch))
        return pb.ProgressAck(epoch=self.worker.epoch, admitted=admitted, admitted_next=admitted_next, served_held=held)
