"""How an ending epoch's gradients become the stage's step: a `Stepper`, with the synchronous and the delayed step
as its two implementations. The epoch protocol (epoch.py) decides *when* an epoch ends; a stepper decides how the
epoch's round and step run and what the stage may serve meanwhile.

- `SynchronousStep`: the round and the step run as one job on the compute thread. Requests queue behind it (the
  event loop, Info and health stay live), so no request sees a half-finished epoch.
- `DelayedStep` (--delay-optimizer-step): the epoch moves on at once; its round runs on the averaging pool while
  the stage computes the next epoch with the previous parameters, and the step lands when the round is over
  (delayed parameter updates). A call admitted two epochs past the one being averaged waits for that step
  (`must_wait`).
- `LocalStep` (--local-batch, the DiLoCo family): each peer takes inner steps alone as its samples come (the worker,
  every --local-batch of them); the epoch's end is an outer round: the stage averages the peers' pseudo-gradients and
  every peer takes the same outer step (server/outer.py). The round and the step run as one job, as synchronous ones.

All three average through `average` below: the stage's round, and beside it the tied weight's round of stage 0 and the last
stage. What a stepper writes and the epoch protocol reads: `averaged` (the last epoch whose stage round ended for us;
our Progress says it), `diverged` and `diverged_at` (we stepped alone after a failed delayed round). Each is an int or
a bool, written by one thread at a time.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import math
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from server.collab.averaging import Averaging
from server.collab.progress import StagePeers
from server.collab.recovery import Recovery
from server.collab.tied import TiedAveraging, TiedOutcome, split, unsplit
from server.config import AveragingConfig
from server.worker import StageWorker

logger = logging.getLogger(__name__)

Tell = Callable[[bool], Coroutine[Any, Any, None]]  # tell(via_hubs): our count to the stage's peers


def with_tied(
    averaged: list[torch.Tensor], tied: TiedOutcome | None
) -> tuple[list[torch.Tensor | None], dict[int, list[torch.Tensor]]]:
    """The step's gradients and the parameters to load first, given the tied weight's round (if any)."""
    if tied is None:
        return list(averaged), {}
    return tied.into(averaged), tied.load


class Stepper(abc.ABC):
    """Build with the stage's parts; `loop` is set by `StageCollaboration.start`; `close` when done."""

    def __init__(
        self,
        worker: StageWorker,
        averaging: Averaging,
        tied: TiedAveraging | None,
        peers: StagePeers,
        recovery: Recovery,
        cfg: AveragingConfig,
        stage: int,
        pool: ThreadPoolExecutor,
        tell: Tell,
        stopping: Callable[[], bool],
    ):
        self.worker, self.averaging, self.tied, self.peers, self.recovery = worker, averaging, tied, peers, recovery
        self.cfg, self.stage, self.pool, self.tell, self.stopping = cfg, stage, pool, tell, stopping
        self.averaged: int | None = None  # the last epoch whose stage round ended for us
        self.diverged = False  # stepped alone after a failed delayed round: we may differ from the stage
        self.diverged_at = -1  # the epoch whose round failed for us, when we diverged
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop's, for the compute thread
        self._tied_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tied-allreduce")

    @abc.abstractmethod
    async def step(self, epoch: int, n_peers: int, skip_to: int | None) -> None:
        """Event loop, as `epoch` ends with `n_peers` in its group (us included): average and step. `skip_to`: stage 0
        is already there, and the epochs between are left without a step."""

    def must_wait(self, admitted_at: int, ending: int) -> bool:
        """Whether a call admitted at `admitted_at` waits while the epoch `ending` is being averaged."""
        return False

    def close(self) -> None:
        self._tied_pool.shutdown(wait=False, cancel_futures=True)

    def skip_if_empty(self, epoch: int, n_peers: int, skip_to: int | None = None) -> bool:
        """Compute thread, as `epoch` ends: alone with no samples towards it (our peers' counts died with them, or
        stage 0 moved on without us), end it without a step, and the empty ones stage 0 has already finished too
        (`skip_to`). With peers the round still runs, even if nobody has samples: a peer that skipped while a peer
        whose count it had not heard yet ran the round would put the stage on two parameter versions. Alone with no
        samples, a step would be a step on zero gradients."""
        if n_peers > 1 or self.worker.samples_accumulated + self.worker.samples_late > 0:
            return False
        self.worker.skip_to(max(epoch + 1, skip_to or 0))
        self.averaged = epoch
        return True

    def average(
        self, grads: list[torch.Tensor], n: int, n_peers: int, epoch: int, wait_for_peers: bool
    ) -> tuple[list[torch.Tensor] | None, TiedOutcome | None]:
        """Averaging pool or compute thread: (the stage's average, None if its round failed; the tied weight's round,
        None without tied embeddings). `wait_for_peers`: the peers' reports of the next epoch mean this round ended
        for them (synchronous steps); with delayed steps they report it while the round still runs. The tied
        weight's round runs beside the stage's, on a thread of its own: a peer whose stage round failed while its
        stage peer's ended learns so from that peer's report of the next epoch, which comes only once that peer's
        tied round is over, and that round waits for every peer of both stages; run one after the other, a stage
        peer retrying a failed round would hold the other stage's tied round until both timed out."""
        rest, tied_grad = split(grads, self.worker.tied_index)
        tied_round = None
        if self.tied is not None and tied_grad is not None and self.worker.tied is not None:
            # the weight and its optimizer state, copied only when the round averages them (3 copies of the weight)
            state = self.worker.tied_state() if self.tied.averages_states(epoch) else None
            # a peer of our stage that finished the epoch has had its tied round: ours cannot meet it any more
            moved_on = (lambda: bool(self.peers.ahead_of(epoch))) if wait_for_peers else (lambda: False)
            tied_round = self._tied_pool.submit(self.tied.average_tied, tied_grad, state, n, epoch, moved_on)
        averaged = self._average_stage(rest, n, n_peers, epoch, wait_for_peers)
        tied = None if tied_round is None else tied_round.result()
        return (None if averaged is None else unsplit(averaged, self.worker.tied_index, tied_grad)), tied

    def _average_stage(
        self, grads: list[torch.Tensor], n: int, n_peers: int, epoch: int, wait_for_peers: bool
    ) -> list[torch.Tensor] | None:
        """A round that ended for every peer but us is over (StagePeers.round_over). A lone step ends the epoch's
        round for us too: our Progress says so, and a peer that still waits for us in one stops."""
        if n_peers <= 1:
            self.averaged = epoch
            return grads
        averaged = self.averaging.gradients.average(
            grads,
            n,
            label=f"stage {self.stage} epoch {epoch}",
            round_tag=epoch,
            finished_without_us=lambda: self.peers.round_over(epoch, delayed=not wait_for_peers),
            retry_grace=self.cfg.matchmaking_time / 2,
            nobody_left=lambda: not self.peers.group(epoch),
            group_size=n_peers,
            group=(lambda: self.peers.group_p2p_ids(epoch)) if self.cfg.fixed_groups else None,
        )
        if averaged is None and not self.peers.group(epoch) and self.peers.recovering:
            # the peers it waited for said meanwhile that they are copying a state (ours, once we share it): none of
            # them steps on this epoch, so our step is the stage's, as a lone step would have been
            logger.info(
                "stage %d epoch %d: the stage's other peers are copying its state; stepping alone", self.stage, epoch
            )
            averaged = grads
        if averaged is not None:
            self.averaged = epoch  # an int, written once by this thread: our next Progress carries it
            assert self.loop is not None
            self.loop.call_soon_threadsafe(self.peers.establish, self.averaging.gradients.last_group)
        return averaged


class SynchronousStep(Stepper):
    async def step(self, epoch: int, n_peers: int, skip_to: int | None) -> None:
        await self.worker.submit(lambda: self._average_and_step(n_peers, skip_to))

    def _average_and_step(self, n_peers: int, skip_to: int | None = None) -> None:
        """Compute thread. Requests queue behind this, so none sees a half-finished epoch."""
        epoch = self.worker.epoch
        if self.skip_if_empty(epoch, n_peers, skip_to):
            return
        grads, n = self.worker.take_gradients()
        # read before the step: the lineages our peers reported for this epoch
        reference = self.peers.lineage_reference(epoch, self.worker.lineage) if n_peers > 1 else None
        averaged, tied = self.average(grads, n, n_peers, epoch, True)
        if averaged is None and self.stopping():  # the round failed because we are stopping: no recovery
            self.worker.return_gradients(grads, n)
            return
        if averaged is None:
            averaged, reference = self.recovery.after_failed_round(grads, n), None  # that recovery decides alone
        if averaged is not None:
            merged, load = with_tied(averaged, tied)
            self.worker.apply_gradients(merged, end_epoch=True, load=load)
            if n_peers <= 1 and n > 0:
                self.worker.branch()  # peers we did not know of may have stepped too, alone or together
        if self.worker.epoch == epoch or self.stopping():  # stopping: no state to copy, no parameters to average
            return
        if reference is not None:
            # peers that each stepped alone (two that started together, before either listed the other) hold
            # different parameters, and an all-reduce of gradients keeps them apart: one lineage copies the other
            self.recovery.adopt(reference, epoch)
        if skip_to is not None and skip_to > self.worker.epoch:  # stage 0 left these epochs with no sample of ours
            self.worker.skip_to(skip_to)
        parameters = self.averaging.parameters  # built with --param-average-every only
        if n_peers > 1 and parameters is not None and self.worker.epoch % self.cfg.param_average_every == 0:
            # tell the stage first: a peer copying our state after a failed round waits for our new epoch
            assert self.loop is not None
            asyncio.run_coroutine_threadsafe(self.tell(False), self.loop)
            at = self.worker.epoch  # the peers that stepped with us
            parameters.average(
                self.worker,
                at,
                group_size=1 + len(self.peers.group(at)),
                group=(lambda: self.peers.group_p2p_ids(at)) if self.cfg.fixed_groups else None,
                nobody_left=lambda: not self.peers.group(at),
            )


class DelayedStep(Stepper):
    def __init__(self, *args, spawn: Callable[[Coroutine], object], **kwargs):
        super().__init__(*args, **kwargs)
        self.spawn = spawn

    def must_wait(self, admitted_at: int, ending: int) -> bool:
        """A microbatch of epoch e + 2 or later while e is averaged would be computed with parameters two or more
        steps old, and the worker keeps one next epoch's gradients only: the epochs after it would go into that one.
        Waiting for our step does what a synchronous stage's queue does."""
        return admitted_at > ending + 1

    async def step(self, epoch: int, n_peers: int, skip_to: int | None) -> None:
        """The epoch moves on now and its step lands once its round is over."""
        if await self.worker.submit(lambda: self.skip_if_empty(epoch, n_peers, skip_to)):
            return
        state = self.averaging.state
        state.allow_state_sharing = False  # a peer that took our state meanwhile would miss the step
        grads, n = await self.worker.submit(lambda: self.worker.take_gradients(end_epoch=True))
        # the lineages our peers reported, read before our step (as with synchronous steps)
        reference = self.peers.lineage_reference(epoch, self.worker.lineage, moved_on=True) if n_peers > 1 else None
        # peers report the next epoch while this one is still being averaged in the background
        averaged, tied = await asyncio.get_running_loop().run_in_executor(
            self.pool, self.average, grads, n, n_peers, epoch, False
        )
        if averaged is None:  # resynced by the epoch protocol's catch-up instead
            averaged, self.diverged, self.diverged_at, reference = grads, True, epoch, None
        else:  # a peer whose round failed stops retrying once every peer said so (`_average_stage`)
            self.spawn(self.tell(True))
        if n > 0 or not self.diverged:  # stepping alone on no samples would be a momentum-only step
            await self.worker.submit(lambda: self._apply(averaged, tied, alone=n_peers <= 1 and n > 0))
            if self.diverged:
                self.recovery.not_an_ancestor()  # our own gradients: the stage goes on from another step
        state.allow_state_sharing = True
        if reference is not None:  # peers of another history stepped with us: copy one
            await self.worker.submit(lambda: self.recovery.adopt(reference, epoch, keep_gradients=True))

    def _apply(self, averaged: list[torch.Tensor], tied: TiedOutcome | None, alone: bool) -> None:
        """Compute thread: a delayed step. `alone`: as with synchronous steps, peers we did not know of may have
        stepped too, so our parameters now have a history of their own."""
        merged, load = with_tied(averaged, tied)
        self.worker.apply_gradients(merged, load=load)
        if alone:
            self.worker.branch()


class LocalStep(Stepper):
    """Inner steps are the worker's (`StageWorker.inner_step`); this runs the outer round as an epoch ends. With H
    inner steps per peer between outer rounds (H = --samples-per-step / (peers x --local-batch)), a stage's peers
    send one round's bytes per H steps. The outer interval is counted in samples, as synchronous epochs are: the stage
    already agrees on those counts (signed, proven by stage 0's admissions), where inner steps differ from peer to
    peer with their speed."""

    def __init__(
        self, *args, local_batch: int, outer_lr: float, outer_momentum: float, samples_per_step: int, **kwargs
    ):
        super().__init__(*args, **kwargs)
        # a peer's samples in an interval: at most its epoch's, and as many late or early beside them (generous: the
        # bound refuses what no inner steps make, not what these ones did), plus the step on the rest
        steps = 2 * math.ceil(samples_per_step / local_batch) + 2
        self.worker.enable_local_steps(local_batch, outer_lr, outer_momentum, steps)

    async def step(self, epoch: int, n_peers: int, skip_to: int | None) -> None:
        await self.worker.submit(lambda: self._outer_round(n_peers, skip_to))

    def _outer_round(self, n_peers: int, skip_to: int | None) -> None:
        """Compute thread. A round that fails changes nothing of the outer state (it fails closed): our inner steps go
        on, our samples stay counted towards the epoch, and the next try of the round, or a copy of the state of a
        peer that finished the epoch (the catch-up), ends it."""
        epoch = self.worker.epoch
        if self.skip_if_empty(epoch, n_peers, skip_to):
            return
        pseudo, n = self.worker.pseudo_gradients()
        reference = self.peers.lineage_reference(epoch, self.worker.lineage) if n_peers > 1 else None
        averaged, _ = self.average(pseudo, n, n_peers, epoch, True)
        if averaged is None:
            if not self.stopping():
                logger.warning(
                    "stage %d epoch %d: the outer round failed; the outer state stays the stage's last",
                    self.stage,
                    epoch,
                )
            return
        self.worker.outer_step(averaged)
        if n_peers <= 1 and n > 0:
            self.worker.branch()  # peers we did not know of may have stepped too, alone or together
        if self.stopping():
            return
        if reference is not None:  # peers of another history took this round with us: copy one
            self.recovery.adopt(reference, epoch)
        if skip_to is not None and skip_to > self.worker.epoch:  # stage 0 left these epochs with no sample of ours
            self.worker.skip_to(skip_to)
