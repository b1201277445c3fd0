"""Tied embeddings across stages: the token embedding (stage 0) and the LM head (the last stage) are one weight, of
which each of the two stages holds a copy (swarm/model.py).

Both copies stay equal because both stages step them with the same gradient: the sum of stage 0's mean gradient and
the last stage's, the gradient one process computes for the one weight. It comes from one all-reduce over the peers
of both stages (Optimus-CC's fused embedding synchronization), in place of an all-reduce within each stage followed
by a sync between the two: each peer sends its mean gradient weighted by its samples, so the round's weighted mean is
(N_0 g_0 + N_L g_L) / (N_0 + N_L), and twice that is g_0 + g_L when the two stages' epochs hold the same samples
(they do: every microbatch carries the global batch stage 0 gave it, and each stage's epoch e is that batch).

The round is a fixed group: the ready peers the DHT lists on either stage, read by the event loop's poller; peers
whose views differ meet nobody and retry until --averaging-timeout. The last stage ends its epoch first and waits
in the round for stage 0 to end the same one (the backward pass still has to reach it); stage 0 needs nothing of the
last stage to end it, so the wait cannot deadlock. A round that fails leaves the tied weight unstepped for that epoch
on the peers it failed for. It can end for some peers and fail for others, whose copies then differ: every
--tied-average-every epochs the round also averages the copies themselves and their optimizer state (moments and
step count; before the step, with the parameter averaging codec), which makes them equal again. Weights alone would
not: copies whose moments differ step apart again (seen: 8e-4 apart three epochs after such an average).

Joiners of either stage download the tied weight with the rest of their stage's state, so they hold what their stage
holds. The tied weight's gradient is clipped on its own (`swarm.model.clip_gradients`): both stages scale it alike.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Callable

import torch
from hivemind.compression import NoCompression, PerTensorCompression

from dht.node import SwarmDHT
from server.collab.compat.averager import StrictAverager
from server.collab.rounds import GradientAveraging, butterfly_bytes
from server.collab.stage_averager import hivemind_compression
from server.config import AveragingConfig
from server.worker import StageWorker
from swarm.compression import get_codec
from swarm.protocol.rpc import PROTOCOL_VERSION

logger = logging.getLogger(__name__)
PHASE_TIED = "tied"  # a round of the tied weight's gradient
PHASE_TIED_WEIGHTS = "tied+weights"  # ... that also averages the tied weight's copies and their optimizer state
READ_AGAIN_S = 2.0  # the longest a retry waits for a fresh DHT read of who serves the two stages


@dataclasses.dataclass
class TiedOutcome:
    """What a tied round gives the step: the gradient of the tied weight (None: it does not step this epoch), and the
    average of its copies' states (`StageWorker.tied_state`), to take before the step (None: keep ours)."""

    index: int  # of the tied weight among the worker's parameters
    grad: torch.Tensor | None
    state: list[torch.Tensor] | None = None

    def into(self, grads: list[torch.Tensor]) -> list[torch.Tensor | None]:
        merged: list[torch.Tensor | None] = list(grads)
        merged[self.index] = self.grad
        return merged

    @property
    def load(self) -> dict[int, list[torch.Tensor]]:
        return {} if self.state is None else {self.index: self.state}


def split(grads: list[torch.Tensor], index: int | None) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """(the gradients the stage's own round averages, the tied weight's) of a worker's gradient list."""
    if index is None:
        return grads, None
    return grads[:index] + grads[index + 1 :], grads[index]


def unsplit(rest: list[torch.Tensor], index: int | None, tied: torch.Tensor | None) -> list[torch.Tensor]:
    """Inverse of `split`."""
    if index is None or tied is None:
        return rest
    return [*rest[:index], tied, *rest[index:]]


class TiedAverager(StrictAverager):
    """Buffers in shared memory: the tied weight's gradient, then its state (`StageWorker.tied_state`: the weight, its
    two moments, its step count). A round averages the gradient, or all of them (PHASE_TIED_WEIGHTS)."""

    def __init__(self, shape: torch.Size, **kwargs):
        tensors = [torch.zeros(shape) for _ in range(4)] + [torch.zeros(1)]
        super().__init__(averaged_tensors=tensors, **kwargs)

    def round_tensors(self, gathered: object, local: list[torch.Tensor]) -> list[torch.Tensor]:
        phase = gathered[1] if isinstance(gathered, list | tuple) and len(gathered) == 3 else None
        if phase == PHASE_TIED:
            return local[:1]
        if phase == PHASE_TIED_WEIGHTS:
            return local
        raise ValueError(f"a round of phase {phase!r} on the tied weight's averager")


class TiedAveraging(GradientAveraging):
    """The tied weight's round, on a stage peer of stage 0 or the last stage. Compute thread or averaging pool, but
    `refresh` (the event loop)."""

    attempt_log_level = logging.INFO  # an attempt that fails is retried, and reported if the round fails

    def gather_timeout(self) -> float:
        """The last stage reaches the round before stage 0 (whose backward is still on its way): its attempt waits
        for stage 0 for the whole --averaging-timeout. Short attempts retried one after the other share one group id
        (it hashes the members and the round), and a stage-0 peer that came in the middle of one waited out the
        timeout on the attempt its partners had left (4 of 44 epochs in a 90 s swarm-local run)."""
        return self.cfg.averaging_timeout

    def __init__(
        self,
        averager: TiedAverager,
        cfg: AveragingConfig,
        sdht: SwarmDHT,
        stage: int,
        stages: tuple[int, int],
        index: int,
    ):
        super().__init__(averager, cfg, get_codec(cfg.tied_codec))
        self.sdht, self.stage, self.stages, self.index = sdht, stage, stages, index
        self.listed: dict[int, frozenset[str]] = {s: frozenset() for s in stages}  # ready peers' libp2p ids, by stage
        self.members = self._members
        self.rounds_skipped = 0  # epochs a tied round did not run: a stage had no listed peer
        self.weight_caps = self._caps
        # the epoch -> what our own stage's peers' admissions prove (served.py), by libp2p id; the most a peer can
        # hold for an epoch (`cap_own_stage`)
        self._proven: Callable[[int], dict[str, float]] = lambda _epoch: {}
        self._most = math.inf
        self._named: set[str] = set()  # the members `_members` last gave: the group the next attempt is told of
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop's, which reads the DHT (set at start)

    async def refresh(self) -> None:
        """Event loop: who serves either stage, as the DHT lists them (peers still joining are left out)."""
        for stage in self.stages:
            entries = await self.sdht.discover(stage)
            self.listed[stage] = frozenset(e.record.p2p_id for e in entries if e.record.p2p_id)

    def averages_states(self, epoch: int) -> bool:
        """Whether the round of `epoch` also averages the copies' states (every --tied-average-every epochs)."""
        return bool(self.cfg.tied_average_every) and epoch % self.cfg.tied_average_every == 0

    def _read_again(self) -> None:
        """Any thread but the event loop's: `refresh`, waited for READ_AGAIN_S at most (else the last read stands)."""
        if self.loop is None:
            return
        future = asyncio.run_coroutine_threadsafe(self.refresh(), self.loop)
        try:
            future.result(timeout=READ_AGAIN_S)
        except Exception as e:  # a timeout, the DHT's errors: the next attempt or poll reads again
            future.cancel()
            logger.debug("reading the tied weight's stages again failed: %r", e)

    def cap_own_stage(self, proven: Callable[[int], dict[str, float]], most: float) -> None:
        """A part of a peer of our own stage weighs in the parts we reduce what its admissions prove to us
        (`proven(epoch)`, as in the stage's own rounds); a peer of the other stage, whose admissions we do not see, at
        most `most` (the samples one peer can hold for an epoch)."""
        self._proven, self._most = proven, most

    def _caps(self, epoch: int) -> dict[str, float]:
        """Any thread: the most each member's part weighs in the parts we reduce of `epoch`'s round."""
        own, proven = self.listed[self.stage], self._proven(epoch)
        # the members the attempt was just told of (a fresh read could leave one out: it would weigh 0 in our parts);
        # a peer of our stage that has not told us of itself yet (no Progress) proves nothing, and is not refused
        return {m: min(self._most, proven.get(m, self._most) if m in own else self._most) for m in self._named}

    def _members(self) -> set[str]:
        self._named = {*self.listed[self.stages[0]], *self.listed[self.stages[1]]} - {self.sdht.p2p_id}
        return set(self._named)

    def average_tied(
        self,
        grad: torch.Tensor,
        state: list[torch.Tensor] | None,
        n_samples: int,
        epoch: int,
        finished_without_us: Callable[[], bool] = lambda: False,
    ) -> TiedOutcome:
        """Our mean gradient of the tied weight over `n_samples` -> the sum of both stages' means (None if the round
        failed, or once `finished_without_us()`: a peer of the group moved on, so no retry can meet it); on the
        epochs of --tied-average-every (`averages_states`), also the mean of every copy's `state`
        (`StageWorker.tied_state`, needed on those epochs only)."""
        # every round reads who serves the two stages: a peer that became ready since the last read, even a second
        # ago, would be missing from our group, and the round's one long attempt would wait out the timeout (seen
        # at epoch 0 with reads up to a second old: stage 0 not listed yet, the last stage's tied weight unstepped)
        self._read_again()
        partner = self.stages[1] if self.stage == self.stages[0] else self.stages[0]
        if not self.listed[partner] - {self.sdht.p2p_id}:
            # a stage nobody serves yet (as far as our last read knows): no round to meet, and no step alone
            self.rounds_skipped += 1
            logger.warning("epoch %d: the tied weight does not step: the DHT lists no ready peer of stage %d",
                           epoch, partner)  # fmt: skip
            return TiedOutcome(self.index, None)
        with_weights = self.averages_states(epoch)
        if with_weights and state is None:
            raise ValueError(f"epoch {epoch}: the tied round averages the copies' states, and ours was not given")
        phase = PHASE_TIED_WEIGHTS if with_weights else PHASE_TIED

        def fill(buffers: list[torch.Tensor]) -> None:
            buffers[0].copy_(grad)
            if with_weights and state is not None:  # other epochs send the gradient only
                for buf, t in zip(buffers[1:], state, strict=True):
                    buf.copy_(t)

        attempts = [0]

        def group() -> list[str]:  # a retry reads who serves the stages again: a peer may have joined or left
            attempts[0] += 1
            if attempts[0] > 1:
                self._read_again()
            return sorted(self._members())

        numel = grad.numel()
        gather = [epoch, phase, f"tied-{self.codec.name}"]
        waits = (finished_without_us, 0.0, lambda: False, len(self._members()) + 1, group)
        if not self._run(fill, n_samples, f"tied weight, epoch {epoch}", gather, (numel, numel), *waits):
            return TiedOutcome(self.index, None)
        with self.averager.get_tensors() as buffers:
            summed = buffers[0] * 2
            averaged = [b.clone() for b in buffers[1:]] if with_weights else None
        if not self._finite([summed, *(averaged or [])], f"tied weight, epoch {epoch}"):
            return TiedOutcome(self.index, None)
        if averaged is not None:  # the states travel with the parameter codec (build_tied): weight and two moments
            averaged[2].clamp_(min=0)  # a lossy codec must not make a second moment negative
            codec, size = get_codec(self.cfg.param_average_codec), self.last_group_size
            self.bytes += butterfly_bytes(codec, 3 * numel, torch.float32, size)
            self.fp32_bytes += butterfly_bytes(get_codec("none"), 3 * numel, torch.float32, size)
        return TiedOutcome(self.index, summed, averaged)


def build_tied(
    worker: StageWorker, sdht: SwarmDHT, stage: int, n_stages: int, cfg: AveragingConfig, common: dict
) -> TiedAveraging | None:
    """The tied weight's averaging on stage 0 or the last stage of a model with tied embeddings; None elsewhere.
    Launched, waited for and shut down with the stage's other averagers (`Averaging`)."""
    if worker.tied is None or worker.tied_index is None:
        return None
    state_codec = hivemind_compression(get_codec(cfg.param_average_codec))
    compression = PerTensorCompression(  # the gradient, the weight, its two moments, its step count (exact)
        [hivemind_compression(get_codec(cfg.tied_codec)), state_codec, state_codec, state_codec, NoCompression()]
    )
    averager = TiedAverager(
        worker.tied.shape,
        prefix=f"{sdht.swarm_name}_v{PROTOCOL_VERSION}_tied",
        compression=compression,
        allow_state_sharing=False,
        **common,
    )
    averager.robust_clip = cfg.robust_clip  # a peer sending garbage is bounded here as in the stage's own rounds
    averager.fixed_groups = True  # every tied round runs in the fixed group of both stages' listed peers
    return TiedAveraging(averager, cfg, sdht, stage, (0, n_stages - 1), worker.tied_index)
