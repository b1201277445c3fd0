"""The epoch protocol of a stage: when its peers end an epoch, average, and step.

The peers of a stage accumulate gradients until *together* they have processed the global batch
(`--samples-per-step`; progress.py keeps the count), average them (averaging.py), and step together, so the swarm
trains one model per stage rather than one per peer. The peer whose count completes the batch tells the others to
join the all-reduce; peers that received nothing this epoch take part with weight 0. A failed round, a peer that fell
behind, and a joiner are handled by recovery.py.

Stage 0 decides which global batch a microbatch belongs to when it admits its Forward (gate.py, admission.py), and
every later call of the microbatch carries it: each stage adds the microbatch's gradient to that global batch, and
ends an epoch as soon as a call shows that stage 0 has moved past it. With no lookahead, every sample of a global
batch is computed at one set of parameters on every stage, as in one process: the pipeline drains at each step.
Admission is the only place where the number of trainers and of their microbatches in flight meets the global batch.

How an ending epoch's round and step run is the stepper's (stepper.py): synchronously on the compute thread, or with
`--delay-optimizer-step` in the background while the stage computes with the previous parameters.

Who writes what: the epoch lives in the worker and only the compute thread changes it (with the parameters, under the
worker's state lock); the phase below is the event loop's.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from dht.node import SwarmDHT
from dht.reads import ThrottledRead
from server.collab import rules
from server.collab.averaging import averager_options, build_averaging
from server.collab.compat import check_version
from server.collab.compat.codec import warm_up_8bit
from server.collab.gate import ADMISSION_REPLY_MARGIN_S, Gate
from server.collab.intake import Intake
from server.collab.lowrank import LowRankState
from server.collab.progress import StagePeers
from server.collab.recovery import Recovery
from server.collab.rules import Act, EpochView
from server.collab.served import KEEP_EPOCHS, Served
from server.collab.stepper import DelayedStep, LocalStep, Stepper, SynchronousStep
from server.collab.tickets import Ticket, Tickets, by_signer, ticket_key
from server.collab.tied import TiedAveraging, build_tied
from server.config import AveragingConfig, EpochConfig, NetworkConfig
from server.worker import StageWorker
from swarm.protocol import wire_pb2 as pb

logger = logging.getLogger(__name__)
DIRECT_PEERS_PER_PERIOD = 8  # calls a peer's periodic count makes directly per --announce-period, on average
END_TIMES_KEPT = 32  # epoch ends whose durations Info reports
LOOKUP_INTERVAL_S = 0.25  # the most often unlisted senders of Progress make us read the DHT


def _idle(task: asyncio.Future | None) -> bool:
    return task is None or task.done()


class Behind(Exception):
    """This peer is copying its stage's state, or a call shows it missed epochs of its stage (frozen for a while,
    say): it must not compute with parameters the stage has left behind. The caller gets UNAVAILABLE ("behind: ...")
    and goes to another peer while this one catches up, or comes back to it (trainer.py: not a failure of the peer)."""


class Phase(enum.Enum):
    """What the collaboration is doing. The event loop is the only writer."""

    ACCUMULATING = "accumulating"  # serving; gradients add up towards the epoch's global batch
    ENDING = "ending"  # averaging and stepping (sync: on the compute thread; delayed: in the background)
    RECOVERING = "recovering"  # downloading a peer's state: behind, or stepped alone
    STOPPED = "stopped"


class StageCollaboration:
    """Build anywhere, then on the main thread `await launch()` (hivemind's averagers are forked processes), then
    `await join()` and `await start()` before serving; `await stop()` when done with the stage."""

    def __init__(
        self,
        worker: StageWorker,
        sdht: SwarmDHT,
        stage: int,
        epochs: EpochConfig,
        averaging: AveragingConfig,
        network: NetworkConfig,
    ):
        self.worker, self.sdht, self.stage = worker, sdht, stage
        averaging = averaging.for_stage(stage, worker.stage.cfg.n_stages)
        self.cfg, self.averaging_cfg, self.network = epochs, averaging, network
        self.policy = averaging.policy()
        self.averaging = build_averaging(worker, sdht, stage, averaging, self.policy)
        n_stages = worker.stage.cfg.n_stages
        self.tied: TiedAveraging | None = build_tied(
            worker, sdht, stage, n_stages, averaging, averager_options(sdht, averaging)
        )
        self.averaging.tied = self.tied
        if self.tied is not None and epochs.delay_optimizer_step:
            logger.warning(
                "--tie-embeddings with --delay-optimizer-step: each delayed step waits for the tied weight's round, "
                "which waits for stage 0, and a stage round that ends for one peer and fails for another costs its "
                "stage seconds more than in synchronous mode (README: tied embeddings)"
            )
        # a peer's part weighs its samples in an epoch (gradients) or 1 (parameters): a larger weight is a lie, capped;
        # and the group's parts together weigh one epoch's samples (twice that in a tied round: two stages' peers)
        self.averaging.state.max_weight = float(self._most_samples())
        self.averaging.state.max_total_weight = float(self._epoch_total())
        if self.tied is not None:
            self.tied.averager.max_weight = float(self._most_samples())
            self.tied.averager.max_total_weight = float(2 * self._epoch_total())
        self.peers = StagePeers(sdht, stage, network.peer_timeout)
        self.averaging.restrict_to(self.peers.members)  # strangers under the stage's prefix never join a round
        self.tickets = Tickets(sdht, network.peer_timeout, vet=stage != 0)
        self.served = Served(self.tickets)  # a peer's part weighs what its admissions prove (served.py)
        self.peers.believed = lambda: rules.shown(self.view())  # as far as stage 0's admissions show
        self.peers.shown_limit = lambda trusted: rules.shown_limit(self.view(), trusted)
        self.averaging.cap_weights(self._proven_weights)
        if self.tied is not None:  # in the tied round too, for our own stage's peers
            self.tied.cap_own_stage(self._proven_weights, float(self._most_samples()))
        self.phase = Phase.ACCUMULATING
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="allreduce")
        self.recovery = Recovery(worker, self.averaging.state, self.peers, averaging, stage, self._pool)
        parts = (worker, self.averaging, self.tied, self.peers, self.recovery, averaging, stage, self._pool)
        self.stepper: Stepper
        if epochs.local_batch:
            self.stepper = LocalStep(
                *parts,
                tell=self._tell,
                stopping=self._stopping,
                local_batch=epochs.local_batch,
                outer_lr=epochs.outer_lr,
                outer_momentum=epochs.outer_momentum,
                samples_per_step=epochs.samples_per_step,
            )
        elif epochs.delay_optimizer_step:
            self.stepper = DelayedStep(*parts, tell=self._tell, stopping=self._stopping, spawn=self._spawn)
        else:
            self.stepper = SynchronousStep(*parts, tell=self._tell, stopping=self._stopping)
        self._kick = asyncio.Event()
        # the DHT reads an unlisted sender of Progress triggers
        self._lookup = ThrottledRead(self.peers.refresh, LOOKUP_INTERVAL_S, network.peer_timeout)
        self.gate = Gate(  # stage 0's admissions (gate.py)
            worker,
            self.peers,
            self.tickets,
            sdht.peer_id,
            epochs,
            self._most_samples(),
            stopped=self._stopping,
            behind=lambda: self.phase is Phase.RECOVERING or rules.behind_for_admission(self.view()),
            kick=lambda: self._kick.set(),
            tell=self._tell,
            spawn=self._spawn,
        )
        self.intake = Intake(  # the stage peers' Progress (intake.py)
            worker,
            self.peers,
            self.served,
            self.gate,
            stage,
            sdht.peer_id,
            self._most_samples(),
            lookup=lambda: self._lookup(),
            greet=self._greet,
            ended=self._on_end_message,
            kick=lambda: self._kick.set(),
            phase=lambda: self.phase.value,
        )
        self._stepped = asyncio.Event()  # set while no epoch is ending (`_step_before`)
        self._stepped.set()
        # set unless an ending epoch's step is yet to be queued on the compute thread (`_wait_for_the_step_job`)
        self._step_queued = asyncio.Event()
        self._step_queued.set()
        self._tasks: set[asyncio.Task] = set()
        self._poller: asyncio.Task | None = None
        self._ending: int | None = None  # the epoch we last began to end
        self._joined_at: int | None = None  # the epoch we started serving the stage in (rules.py `trusting`)
        # the poller's DHT read, and its check of the epoch's end: one of each at a time
        self._refreshing: asyncio.Future | None = None
        self._checking: asyncio.Future | None = None
        self._end_times: deque[float] = deque(maxlen=END_TIMES_KEPT)  # seconds of our latest epoch ends
        self._last_direct = -math.inf  # when our count last went to every peer rather than through hubs (`_refresh`)

    @property
    def epoch(self) -> int:
        return self.worker.epoch

    def batch_done(self) -> float:
        return (self.worker.samples_accumulated + self.peers.samples_in(self.epoch)) / self.cfg.samples_per_step

    @property
    def address(self) -> str:
        return self.peers.address

    @address.setter
    def address(self, value: str) -> None:
        self.peers.address = value

    @property
    def progress_bytes(self) -> int:
        return self.peers.bytes_sent + self.peers.hub.bytes_sent

    @property
    def progress_calls(self) -> tuple[int, int]:
        return self.peers.calls_sent + self.peers.hub.calls, self.peers.messages_taken

    @property
    def epoch_end_s(self) -> list[float]:
        return list(self._end_times)

    @property
    def allreduce_bytes(self) -> int:
        return self.averaging.bytes

    @property
    def allreduce_fp32_bytes(self) -> int:
        return self.averaging.fp32_bytes

    @property
    def rounds_ok(self) -> int:
        return self.averaging.gradients.rounds_ok

    @property
    def rounds_failed(self) -> int:
        return self.averaging.gradients.rounds_failed

    @property
    def state_downloads(self) -> int:
        return self.recovery.downloads

    def shared_digest(self) -> tuple[int, str] | None:
        return self.averaging.state.shared_digest()

    @property
    def lowrank(self) -> LowRankState | None:
        return self.averaging.state.lowrank

    @property
    def compression(self) -> str:
        described = self.policy.describe()
        if self.lowrank is None:
            return described
        cfg = self.averaging_cfg
        return f"{described} (as {cfg.scheme} factors after {cfg.allreduce_warmup_epochs} whole epochs)"

    @property
    def busy(self) -> bool:
        return self.phase in (Phase.ENDING, Phase.RECOVERING)

    # --- lifecycle -------------------------------------------------------------------------------------------------

    async def launch(self, timeout: float = 60.0) -> None:
        """Main thread (the event loop's): fork the averagers' processes, then wait for them off the loop.

        The 8-bit codec builds its tables on first use: built here first, the averagers inherit them instead of each
        building them inside its first all-reduce (when that imported bitsandbytes, seconds on a loaded machine, the
        round overran --averaging-timeout)."""
        check_version()
        if self.averaging_cfg.wire_codec == "blockwise8":
            await asyncio.to_thread(warm_up_8bit)
        self.averaging.launch()
        await asyncio.to_thread(self.averaging.wait_until_ready, timeout)

    async def join(self) -> bool:
        return await self.recovery.join()

    async def start(self) -> None:
        """Start watching the stage. Call after `join` (and any checkpoint load)."""
        self.averaging.state.state_sharing_priority = self.worker.param_version
        loop = self.recovery.loop = self.stepper.loop = asyncio.get_running_loop()
        self._joined_at = self.epoch
        if self.tied is not None:
            self.tied.loop = loop
        await self._refresh_tied()
        self._poller = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        self.phase = Phase.STOPPED
        self.gate.wake()  # waiting admissions see the stop and refuse
        pending = [t for t in (self._poller, *self._tasks) if t is not None]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self.peers.close()
        await self.tickets.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.stepper.close()
        await asyncio.to_thread(self.averaging.shutdown)

    async def finish_epoch(self, timeout: float) -> int:
        """Before leaving the stage (no new work arrives): wait until our gradients went into an all-reduce, i.e. the
        stage's current epoch ended. Returns the samples whose gradients are dropped because it did not end in time."""
        deadline = time.monotonic() + timeout

        def pending() -> int:
            return self.worker.samples_accumulated + self.worker.samples_next

        while (pending() > 0 or self.busy) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return pending()

    # --- the epoch protocol ----------------------------------------------------------------------------------------

    async def after_backward(self) -> None:
        """Event loop, after every backward and before its reply: tell the stage our count (so that the epoch ends
        exactly at the global batch), and end the epoch if it is full. The reply does not wait for the step: the
        step is a control job that runs before any request still queued, and the all-reduces of consecutive stages
        overlap instead of adding up along the backward pass."""
        await self._broadcast(end_epoch=False, via_hubs=True)
        self._spawn(self._maybe_end_epoch())

    async def on_progress(self, msg: pb.StageProgress) -> pb.ProgressAck:
        """A stage peer's count (intake.py); the poller acts on it. Raises ProgressRefused for one that must not
        count."""
        return await self.intake.on_progress(msg)

    def _greet(self) -> None:
        """Our count to a peer that just started: it waits for it before it admits (gate.py)."""
        self._spawn(self._broadcast(end_epoch=False))

    def _on_end_message(self, epoch: int, sender: str) -> None:
        """`sender` asks the stage to end `epoch`: we do now if the rules say so (rules.py `on_end_message`)."""
        if rules.on_end_message(self.view(), epoch, sender):
            self._spawn(self._end_epoch_once(epoch))

    def _most_samples(self) -> int:
        """The largest count a peer can report for one epoch: the global batch, the lookahead, and one microbatch."""
        return self.cfg.samples_per_step + self.cfg.lookahead_samples + self.worker.compute_cfg.max_batch_size

    def view(self) -> EpochView:
        """Any thread: what the epoch rules (rules.py) decide on, as it stands now (the compute thread may move the
        epoch on meanwhile: every field is read against one reading of it)."""
        epoch = self.epoch
        return EpochView(
            stage=self.stage,
            epoch=epoch,
            quota=self.cfg.samples_per_step,
            lookahead=self.cfg.lookahead_samples,
            held=self.worker.samples_accumulated,
            proven=self.served.distinct(epoch),
            stage0_at=self.tickets.stage0_at(by_signer(self.worker.recent_admissions())),
            joined_at=self._joined_at,
            ending=self._ending,
            accumulating=self.phase is Phase.ACCUMULATING,
            diverged=self.stepper.diverged,
            peer_epochs={p: e for p, (e, _) in dict(self.peers.view).items()},
            refused_at=self.peers.refused_at(),
            established=frozenset(self.peers.established),
        )

    def _proven_weights(self, epoch: int) -> dict[str, float]:
        """Any thread: the most each listed peer's part may weigh in our parts of `epoch`'s round, by libp2p id."""
        unheard = float(self.worker.compute_cfg.max_batch_size)
        return {p2p: float(self.served.cap(p, epoch, unheard)) for p, p2p in dict(self.peers.p2p_ids).items() if p2p}

    def _epoch_total(self) -> int:
        """The most samples the peers of a stage can hold together for one epoch's round: what one peer can report
        (`_most_samples`), and a microbatch counted twice (a Backward retried on another peer after its reply was
        lost)."""
        return self._most_samples() + self.worker.compute_cfg.max_batch_size

    def _spawn(self, coroutine) -> asyncio.Future:
        task = asyncio.get_running_loop().create_task(coroutine, name=coroutine.__qualname__)
        self._tasks.add(task)  # asyncio keeps only weak references to tasks
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("%s failed: %r", task.get_name(), task.exception())

    async def _tell(self, via_hubs: bool) -> None:
        """Our count to the stage (the stepper's `tell`)."""
        await self._broadcast(end_epoch=False, via_hubs=via_hubs)

    def _stopping(self) -> bool:
        return self.phase is Phase.STOPPED

    async def _broadcast(self, end_epoch: bool, ending: int | None = None, via_hubs: bool = False) -> None:
        """`ending`: the epoch whose round we are in; we tell the peers to end it if we are still in it (a round's
        heartbeat, which goes to every peer: one that does not take it leaves the group). `via_hubs`: through the
        epoch's hubs in a stage of many peers (hubs.py)."""
        worker = self.worker
        while True:  # the compute thread may end the epoch between the reads: read them all from the same epoch
            epoch, samples, lineage = self.epoch, worker.samples_accumulated, worker.lineage
            served = worker.served_for(epoch)  # the admissions behind our count (served.py),
            taken = worker.taken_before(epoch)  # and behind our weight in the round we are in, of an earlier epoch
            if self.epoch == epoch:
                break
        end_epoch = end_epoch or epoch == ending
        latest = self.tickets.latest  # why we end `epoch` without its global batch, if stage 0 is past it
        await self.peers.broadcast(
            epoch,
            samples,
            end_epoch,
            self.gate.admission.counts(epoch),
            not self.gate.admitting,
            lineage=lineage,
            averaged=self.stepper.averaged,
            recovering=self.phase is Phase.RECOVERING,
            served=served,
            taken=taken,
            moved_on=latest if latest is not None and latest.admitted_at > epoch else None,
            via_hubs=via_hubs and ending is None,
        )

    async def admit(self, microbatch_id: str, n: int, deadline: float | None = None, caller: str = "") -> Ticket:
        """Event loop, stage 0, before a Forward (gate.py `admit`)."""
        return await self.gate.admit(microbatch_id, n, deadline, caller)

    def release(self, ticket: Ticket, microbatch_id: str, n: int) -> None:
        """Event loop: an admitted microbatch failed before it was computed; it will not come back."""
        self.gate.release(ticket, microbatch_id, n)

    def unobserve(self, meta: pb.CallMeta) -> None:
        self.tickets.forget(meta)

    async def stop_admitting(self) -> None:
        """Event loop: this peer leaves the stage; its stage-0 peers stop holding a share of each batch for it."""
        await self.gate.stop_admitting()

    async def observe(
        self,
        meta: pb.CallMeta,
        samples: int,
        backward: bool,
        on_spent: Callable[[], None] | None = None,
        deadline: float | None = None,
    ) -> None:
        """Event loop, before every call but stage 0's admissions: raises TicketRefused unless the call's admission is
        signed by a stage-0 peer (tickets.py; a Backward must have one). The microbatch was admitted at stage 0's
        epoch `admitted_at`: stage 0 had then finished every epoch before it, so every microbatch of ours before it
        has passed us too. If we are still in such an epoch, end it now (before the call runs: the step is a control
        job and goes first). A peer several epochs behind (restarted from a checkpoint with the stage's other peers
        gone) skips the epochs that have no samples of its own. A Backward refused here has not spent its admission:
        its retry, here or on another peer, is judged afresh. `on_spent`, `deadline`: see Collaboration.observe."""
        await self.tickets.check(meta, samples, backward)
        if backward and meta.admitted_by == self.sdht.peer_id:  # one of ours came back
            self.gate.leases.returned(ticket_key(meta), time.monotonic())
        try:
            if backward and on_spent is not None:
                on_spent()
            await self._observe(meta, deadline)
        except BaseException:
            if backward:
                self.tickets.forget(meta)
            raise

    def precheck(self, meta: pb.CallMeta, backward: bool) -> None:
        self.tickets.precheck(meta, backward)

    async def _observe(self, meta: pb.CallMeta, deadline: float | None) -> None:
        if self.phase is Phase.RECOVERING:
            raise Behind(f"behind: stage {self.stage}: this peer is copying the stage's state; try another peer")
        if not meta.HasField("admitted_at"):
            return
        await self._step_before(meta.admitted_at, deadline)
        admitted_at, epoch = meta.admitted_at, self.epoch
        # on stage 0, the admission's signer is a peer of ours, and it was at `admitted_at` when it signed: a peer
        # thawed after a freeze took such a Backward before it heard that its peer was ahead, skipped to the
        # admission's epoch, and lost the gradient when it caught up (a soak's 30 s stall: stage 0 waited
        # --admission-timeout for those samples)
        signer_is_peer = self.stage == 0 and meta.admitted_by != self.sdht.peer_id
        # (the view only then: it adds up what our peers proved, on every call otherwise)
        decision = rules.on_call(self.view(), admitted_at, signer_is_peer) if admitted_at > epoch else None
        if decision is not None and decision.act is Act.BEHIND:
            self._kick.set()  # the poller catches up from the peer furthest ahead
            raise Behind(
                f"behind: stage {self.stage}: this peer is at epoch {epoch}, stage 0 at {admitted_at}: catching up"
            )
        if decision is not None and decision.act is Act.ANNOUNCE_AND_END:
            logger.debug("stage 0 admits epoch %d: ending our epoch %d", admitted_at, epoch)
            await self._broadcast(end_epoch=True, via_hubs=True)
            if self.epoch == epoch and self.phase is Phase.ACCUMULATING:  # nobody ended it while we told the others
                self._spawn(self._end_epoch_once(epoch, skip_to=admitted_at))
                await asyncio.sleep(0)  # the task runs first (asyncio's ready queue is FIFO): the epoch is ENDING
        await self._wait_for_the_step_job(admitted_at, deadline)

    async def _wait_for_the_step_job(self, admitted_at: int, deadline: float | None) -> None:
        """A call admitted after the epoch that is ending queues its request after that epoch's step: the step may
        first read the DHT (a peer alone looks for peers once more) or stage 0's signers, and a request queued
        meanwhile ran on the parameters of the epoch it was admitted after. Waits until `deadline` (monotonic) at
        most, then raises Behind (the trainer asks again shortly)."""
        ending = self.phase is Phase.ENDING and self._ending is not None and admitted_at > self._ending
        if ending and not self._step_queued.is_set():
            await self._wait_or_behind(self._step_queued, deadline, admitted_at, "is about to step")

    async def _wait_or_behind(self, event: asyncio.Event, deadline: float | None, admitted_at: int, doing: str) -> None:
        """Wait for `event` while the call can still be answered (`deadline`, monotonic); past that, raise Behind:
        the trainer asks again shortly."""
        patience = None if deadline is None else deadline - ADMISSION_REPLY_MARGIN_S - time.monotonic()
        try:
            if patience is not None and patience <= 0:
                raise TimeoutError
            await asyncio.wait_for(event.wait(), patience)
        except TimeoutError:
            raise Behind(
                f"behind: stage {self.stage}: stage 0 is at epoch {admitted_at}, this peer {doing} epoch "
                f"{self._ending}; ask again shortly"
            ) from None

    async def _step_before(self, admitted_at: int, deadline: float | None) -> None:
        """Wait (until `deadline`, a monotonic time) while the epoch being averaged holds calls admitted at
        `admitted_at` back (stepper.py `must_wait`: delayed steps, two epochs on). Raises Behind if the call cannot wait
        any more: the trainer asks again shortly."""
        while (
            self.phase is Phase.ENDING
            and self._ending is not None
            and self.stepper.must_wait(admitted_at, self._ending)
        ):
            await self._wait_or_behind(self._stepped, deadline, admitted_at, "still averages")

    async def _poll_forever(self) -> None:
        """Only spawns: neither a DHT read nor an epoch's end holds this loop, so a round's heartbeats go on meanwhile
        (a DHT read that waited out its timeout on a frozen peer's node delayed them past --peer-timeout, and the
        rounds this loop ran itself had none). One read and one check of the epoch's end run at a time; the tasks
        log their own failures (`_finished`)."""
        last_refresh = last_heartbeat = 0.0
        while True:
            try:
                await asyncio.wait_for(self._kick.wait(), self.cfg.progress_period)
            except TimeoutError:
                pass
            if self.phase is Phase.STOPPED:
                # `stop` cancels this task, but Python 3.11's wait_for returns instead of raising when the wait it
                # was cancelled in has just ended too: a Progress kicked us as we stopped (every 0.1 s in the tests),
                # this loop ran on, and `stop` waited for it for ever (CI: a test's teardown hung 120 s, twice)
                return
            self._kick.clear()
            if self.stage == 0:
                self.gate.release_run_out()
            if self.phase is Phase.ENDING and time.monotonic() - last_heartbeat >= self.network.peer_timeout / 2:
                # while a round runs, tell the peers our count again: one that stopped answering (frozen, dead) leaves
                # the group within --peer-timeout, and a round left with nobody gives up at once instead of holding
                # the compute thread for --averaging-timeout (rounds.py, `nobody_left`). And call into the round a
                # peer still accumulating the epoch (it joined, or copied a state, after our call to end it): it would
                # otherwise come only on its own count, or on a call from a later epoch
                last_heartbeat = time.monotonic()
                self._spawn(self._broadcast(end_epoch=False, ending=self._ending))
            if time.monotonic() - last_refresh > self.network.announce_period and _idle(self._refreshing):
                last_refresh = time.monotonic()
                self._refreshing = self._spawn(self._refresh())
            if _idle(self._checking):
                self._checking = self._spawn(self._maybe_end_epoch())

    async def _refresh(self) -> None:
        await self.peers.refresh()
        # so joiners and restarted peers learn our count, and every peer does even if both hubs withhold: each peer
        # directly every DIRECT_PEERS_PER_PERIOD of --announce-period at most, through the hubs between
        now, direct = time.monotonic(), self.network.announce_period * len(self.peers.peers) / DIRECT_PEERS_PER_PERIOD
        via_hubs = now - self._last_direct < direct
        self._last_direct = self._last_direct if via_hubs else now
        await self._broadcast(end_epoch=False, via_hubs=via_hubs)
        await self._refresh_tied()

    async def _refresh_tied(self) -> None:
        if self.tied is None:
            return
        try:
            await self.tied.refresh()
        except TimeoutError:  # the next poll reads again; the rounds meanwhile use the last read
            logger.debug("stage %d: reading the peers of the tied weight's stages timed out", self.stage)

    async def _maybe_end_epoch(self) -> None:
        view = self.view()
        decision = rules.on_poll(view, lost=self.stage == 0 and self.gate.lost_microbatches(view.epoch))
        if decision.act is Act.CATCH_UP:
            await self._catch_up()
            return
        if decision.act is Act.WAIT:
            return
        if decision.act is Act.ANNOUNCE_AND_END:
            if rules.done(view) < view.quota:
                logger.warning(
                    "stage 0 epoch %d: %d of its %d admitted samples came back in %.0fs; ending the epoch without "
                    "the rest",
                    view.epoch,
                    self.gate.stalled_at[1],
                    self.gate.admission.total(view.epoch),
                    self.cfg.admission_timeout,
                )
            await self._broadcast(end_epoch=True, via_hubs=True)
        await self._end_epoch_once(view.epoch)

    async def _end_epoch_once(self, epoch: int, skip_to: int | None = None) -> None:
        """End `epoch` (if we are still in it): average and step. `skip_to`: stage 0 is already there (observe)."""
        if self.phase is not Phase.ACCUMULATING or epoch != self.epoch:
            return
        logger.debug("ending epoch %d", epoch)
        self.phase, self._ending, began = Phase.ENDING, epoch, time.monotonic()
        self._stepped.clear()
        self._step_queued.clear()
        try:
            try:
                self.peers.forget_before(epoch)
                self.served.forget_before(epoch - KEEP_EPOCHS)
                self.gate.leases.forget_before(epoch + 1)  # the batch is over: its microbatches still away are late
                await self.served.settle(epoch)  # the admissions behind the counts that ended the epoch: the caps
                if self.peers.group_size(epoch) <= 1:
                    # about to step alone: peers that started with us may not be listed yet, and if each stepped
                    # alone the stage would hold two models ever after (two stage-1 peers did, 0.02 apart after 30
                    # steps). A peer with samples has a DHT record (trainers found it there): read the DHT once more
                    await self._lookup()
                n_peers = self.peers.group_size(epoch)
            finally:
                # the calls waiting for our step job run after the submit below (it queues the job before it first
                # yields); set here, before anything else of ours awaits, so that no other ending's is set by ours
                self._step_queued.set()
            await self.stepper.step(epoch, n_peers, skip_to)
        finally:
            if self.phase is Phase.ENDING:
                self.phase = Phase.ACCUMULATING
            self.gate.wake()
            self._stepped.set()
            self._end_times.append(time.monotonic() - began)
        self.averaging.state.state_sharing_priority = self.worker.param_version
        await self._broadcast(end_epoch=False, via_hubs=True)

    async def _catch_up(self) -> None:
        """We missed an epoch, or stepped alone: take the state of the peer furthest ahead of (or beside) us."""
        view = self.view()
        distrusted = rules.lately_refused(view)
        epochs = {p: e for p, e in rules.shown(view).items() if p not in distrusted}
        # with delayed steps, a round can end for our peers and fail for us: those peers hold the stage's model
        stepper = self.stepper
        averaged = self.peers.averaged_since(stepper.diverged_at)
        source, stepper.diverged = rules.catch_up_source(
            self.epoch, epochs, self.sdht.peer_id, stepper.diverged, averaged
        )
        if source is None:
            return
        logger.info(
            "stage %d: behind (epoch %d, swarm at %d) or diverged: downloading the state of %s",
            self.stage,
            self.epoch,
            max([self.epoch, *epochs.values()]),
            source[-6:],
        )
        self.phase = Phase.RECOVERING
        self._spawn(self._broadcast(end_epoch=False))  # our peers leave us out of their rounds meanwhile
        try:
            # a peer that diverged copies one at its own epoch: what it accumulated towards that epoch stays. Dropped,
            # those samples were missing from a count its peers had already added up: the epoch waited for them until
            # --admission-timeout (a 30 s stall of a delayed swarm-local run, "24 of its 32 admitted samples came back")
            # then the others at the source's epoch: the stage's other peers may not hold what the first one sent.
            # Not when we diverged: we copy the peer named, whose state may be its own (nobody vouches for it).
            # Not diverged, we may hold an ancestor of the state we take: one its sender alone holds is then held to
            # ours (a peer alone at the furthest epoch has nobody at its epoch to vouch for or against it)
            at = epochs[source]
            others = [] if at == self.epoch else sorted(p for p, e in epochs.items() if e == at and p != source)
            vouch, checked = at != self.epoch, not stepper.diverged
            for attempts, peer in [(3, source), *((1, p) for p in others)]:
                if await self.recovery.download(
                    peer, attempts=attempts, keep_gradients=True, vouch=vouch, checked=checked
                ):
                    stepper.diverged = False
                    break
        finally:
            if self.phase is Phase.RECOVERING:
                self.phase = Phase.ACCUMULATING
                self._spawn(self._broadcast(end_epoch=False))
            self.gate.wake()
