"""Stage 0's gate: which global batch a microbatch joins, and how long its admission may stay away.

Only stage 0 admits (every peer builds a gate; the others only report its empty counts). Before its Forward runs, a
microbatch is placed in a global batch with room (admission.py: each peer of stage 0 admits its share of the
batch), within its caller's share of the open batches (leases.py), and signed (tickets.py); every later call of the
microbatch carries that admission. A peer that starts reads its stage peers' counts before its first admission, and
claims its share of each epoch before admitting towards it, so that peers that did not know of each other do not
overfill a batch. An admission whose microbatch stayed away past its lease is admitted again: the batch does not
wait for a lost microbatch longer than its callers have shown they need.

Owned by the event loop. What it needs of the collaboration comes in as callables: whether the peer is stopping or
behind, a kick of its poller, and a way to tell the stage our count.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from server.collab import rules
from server.collab.admission import Admission, Decision
from server.collab.leases import Leases
from server.collab.progress import StagePeers
from server.collab.tickets import Ticket, Tickets
from server.config import EpochConfig
from server.worker import StageWorker

logger = logging.getLogger(__name__)
FIRST_ADMISSION_WAIT_S = 2.0  # how long a starting peer waits for its stage peers' counts before admitting
ADMISSION_REPLY_MARGIN_S = 1.5  # a Forward held for the next global batch is refused this long before its deadline


class AdmissionRefused(Exception):
    """This peer's share of the global batch is full, others' are not: the microbatch belongs on another peer; or
    the batch has not stepped yet and the call's deadline is near: the trainer asks again shortly."""


class Gate:
    def __init__(
        self,
        worker: StageWorker,
        peers: StagePeers,
        tickets: Tickets,
        peer_id: str,
        cfg: EpochConfig,
        most_samples: int,
        *,
        stopped: Callable[[], bool],
        behind: Callable[[], bool],
        kick: Callable[[], None],
        tell: Callable[[bool], Coroutine[Any, Any, None]],
        spawn: Callable[[Coroutine], object],
    ):
        self.worker, self.peers, self.tickets, self.peer_id, self.cfg = worker, peers, tickets, peer_id, cfg
        self.most_samples = most_samples  # the largest count a peer can report for one epoch
        self.stopped, self.behind, self.kick, self.tell, self.spawn = stopped, behind, kick, tell, spawn
        self.admission = Admission(peers, cfg.samples_per_step, cfg.lookahead_samples)
        self.leases = Leases(cfg.admission_timeout)  # how long an admission may stay away (leases.py)
        self.admitting = True  # False once the peer is leaving the stage
        self._possible = asyncio.Event()  # set when an admission may have become possible (`wake`)
        self._first_admission: asyncio.Future | None = None  # the DHT read before our first admission
        self._claiming: tuple[int, asyncio.Future] | None = None  # our claim of an epoch's share, in flight
        self.stalled_at = (0, 0, time.monotonic())  # (epoch, samples done, since when) unchanged

    def wake(self) -> None:
        """An admission may have become possible (an epoch ended, a peer's count came, the peer stops)."""
        self._possible.set()

    async def admit(self, microbatch_id: str, n: int, deadline: float | None = None, caller: str = "") -> Ticket:
        """Before a Forward of `n` samples that a Backward will follow: wait (until `deadline`, a monotonic time) for
        a global batch with room. Returns the global batch it joins and our epoch now, signed (tickets.py). Raises
        AdmissionRefused when the microbatch belongs on another peer of stage 0."""

        def patience() -> float | None:  # how long we may still wait before we must answer the caller
            return None if deadline is None else max(deadline - ADMISSION_REPLY_MARGIN_S - time.monotonic(), 0.0)

        if not await self._read_peers_before_first_admission(patience()):
            raise AdmissionRefused("admission: this peer of stage 0 is still meeting its stage's peers; ask again")
        self.leases.asked(caller, time.monotonic())
        while True:
            epoch = self.worker.epoch  # the compute thread may move it on: decide and record against one reading
            if not self.admitting or self.stopped():
                raise AdmissionRefused("admission: this peer of stage 0 is leaving the stage")
            if self.behind():
                self.kick()
                raise AdmissionRefused("admission: this peer of stage 0 is behind its stage, catching up")
            if self.peers.must_claim(epoch):
                if not await self._claim(epoch, patience()):
                    raise AdmissionRefused(
                        "admission: a peer of stage 0 does not count this one among the admitting peers yet"
                    )
                continue  # the epoch may have moved on meanwhile
            open_samples = self.cfg.samples_per_step + self.cfg.lookahead_samples
            share = self.leases.share(caller, open_samples, time.monotonic(), n)
            if (held := self.leases.holds(caller)) + n > share:
                raise AdmissionRefused(
                    f"admission: this caller holds {held} samples of the open global batches, its share while others "
                    f"ask is {share}; ask again once some came back"
                )
            placed = self.admission.place(epoch, n)
            if placed is Decision.REFUSE:
                raise AdmissionRefused(
                    f"admission: stage 0 admits its share of global batch {epoch} on each of its peers; this peer's "
                    f"share is full and another peer's is not"
                )
            if placed is not Decision.WAIT:
                break
            self.leases.waited(caller, time.monotonic())
            if patience() == 0.0:
                # answer while the caller still listens: a call that times out looks like a dead peer to it (a ban),
                # a refusal is retried shortly (a stage further down the pipeline may be slow or frozen meanwhile)
                raise AdmissionRefused(f"admission: global batch {epoch} is full and has not stepped yet; ask again")
            self._possible.clear()
            try:
                await asyncio.wait_for(self._possible.wait(), self.cfg.progress_period)
            except TimeoutError:
                pass
        assert isinstance(placed, int)
        self.admission.record(placed, n, epoch)
        self.leases.grant((self.peer_id, microbatch_id, placed, epoch), caller, placed, n, time.monotonic())
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "admitted %s (%d samples) into batch %d at epoch %d: ours %d, theirs %s, admitting %s",
                microbatch_id,
                n,
                placed,
                epoch,
                self.admission.admitted.get(placed, 0),
                {p[-6:]: self.peers.admitted_by(p, placed) for p in self.peers.peers},
                [p[-6:] for p in self.peers.admitting(placed)],
            )
        if self.peers.peers:  # the other peers of stage 0 count our admissions
            self.spawn(self.tell(True))
        return Ticket(placed, epoch, *self.tickets.sign(microbatch_id, n, placed, epoch))

    async def _claim(self, epoch: int, timeout: float | None = None) -> bool:
        """Before admitting towards `epoch`: make sure every peer counts us among the admitting peers of it, and learn
        what each had admitted when it began to (StagePeers.claim). A peer that saw no admission of ours lately counts
        no share for us and may admit the whole batch: without the claim, a peer that joined late or that trainers
        had not found yet would overfill the batch by its own share. Concurrent admissions share one claim; one that
        cannot wait `timeout` seconds for it gets False meanwhile (a frozen peer holds the claim for --peer-timeout,
        and an unanswered Forward looks like a dead peer to the trainer: a ban, and a doubled deadline)."""
        if self._claiming is None or self._claiming[0] != epoch or self._claiming[1].done():
            current = self.worker.epoch == epoch
            samples = self.worker.samples_accumulated if current else 0
            served = self.worker.served_for(epoch) if current else []  # read after the count: covers it
            claim = self.peers.claim(epoch, samples, self.admission.counts(epoch), self.most_samples, served)
            self._claiming = epoch, asyncio.ensure_future(claim)
        try:
            return await asyncio.wait_for(asyncio.shield(self._claiming[1]), timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.debug("stage 0: claiming a share of global batch %d failed: %r", epoch, e)
            return False

    async def _read_peers_before_first_admission(self, timeout: float | None = None) -> bool:
        """Before our first admission, learn what the other peers of stage 0 admitted: a peer that started alone, or
        before us, may hold more than its share of the open batch. Peers that start together read the DHT before the
        others are listed, so read it again now (a trainer calls us only once it has found us, and by then it
        usually finds them too), tell them our count, and wait (up to FIRST_ADMISSION_WAIT_S) until each has told us
        theirs: a peer answers a stage peer's first message with its own (intake.py `on_progress`). Returns False if
        that is still under way after `timeout` seconds (a DHT read, or a frozen peer's Progress, holds it): answer
        the caller."""
        if self._first_admission is None:
            self._first_admission = asyncio.ensure_future(self._meet_stage_peers())
        try:
            await asyncio.wait_for(asyncio.shield(self._first_admission), timeout)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            return False
        except Exception as e:  # the regular reads go on; a failed one must not refuse the microbatch
            logger.debug("stage 0: meeting the stage's peers before the first admission failed: %r", e)
        return True

    async def _meet_stage_peers(self) -> None:
        await self.peers.refresh()
        if not self.peers.peers:
            return
        await self.tell(False)
        give_up = time.monotonic() + FIRST_ADMISSION_WAIT_S
        while not all(map(self.peers.heard_from, self.peers.peers)) and time.monotonic() < give_up:
            self._possible.clear()
            try:
                await asyncio.wait_for(self._possible.wait(), give_up - time.monotonic())
            except TimeoutError:
                pass

    def release(self, ticket: Ticket, microbatch_id: str, n: int) -> None:
        """An admitted microbatch failed before it was computed; it will not come back."""
        self.leases.released((ticket.signer, microbatch_id, ticket.global_batch, ticket.admitted_at))
        self.admission.release(ticket.global_batch, n)
        if self.peers.peers:
            self.spawn(self.tell(True))

    async def stop_admitting(self) -> None:
        """This peer leaves the stage; its stage-0 peers stop holding a share of each batch for it."""
        self.admitting = False
        self._possible.set()
        await self.tell(False)

    def release_run_out(self) -> None:
        """Admissions whose leases ran out (leases.py) are admitted again: the batch does not wait for them."""
        run_out = self.leases.run_out(time.monotonic())
        for batch, n in run_out:
            self.admission.release(batch, n)
        if run_out:
            logger.info(
                "stage 0: %d admitted microbatches (%d samples) stayed away past their lease; admitting as many again",
                len(run_out),
                sum(n for _, n in run_out),
            )
            self._possible.set()
            if self.peers.peers:
                self.spawn(self.tell(True))

    def lost_microbatches(self, epoch: int) -> bool:
        """Whether `epoch`'s global batch is admitted but its Backwards stopped arriving --admission-timeout ago
        (rules.py `lost_microbatches`). Keeps the time since the samples done last changed."""
        done = self.worker.samples_accumulated + self.peers.samples_in(epoch)
        now = time.monotonic()
        if (epoch, done) != self.stalled_at[:2]:
            self.stalled_at = (epoch, done, now)
        admitted = self.admission.total(epoch)
        if admitted < self.cfg.samples_per_step:
            self.stalled_at = (epoch, done, now)
        stalled_for = now - self.stalled_at[2]
        return rules.lost_microbatches(0, admitted, self.cfg.samples_per_step, stalled_for, self.cfg.admission_timeout)
