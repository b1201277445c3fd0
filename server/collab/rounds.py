"""All-reduce rounds of a stage's averager: each attempt's group, gather and timeout, retries within
--averaging-timeout, and what gradient, low-rank gradient and parameter averaging each put in a round. Compute thread
or the collaboration's averaging pool, never the event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import torch
from hivemind.averaging.control import StepControl
from hivemind.averaging.partition import AllreduceException
from hivemind.utils import get_dht_time

from server.collab.compat.averager import AveragerClosed, StrictAverager
from server.collab.lowrank import (
    PHASE_FULL,
    PHASE_P,
    PHASE_PSGD_P,
    PHASE_PSGD_Q,
    PHASE_Q,
    AcpState,
    LowRankState,
    PowerSgdState,
)
from server.collab.stage_averager import PHASE_DIGEST, PHASE_PARAMS, PROBE_TENSORS, StageAverager
from server.config import AveragingConfig
from server.state import state_digest
from server.worker import StageWorker
from swarm.compression import Codec, get_codec

ABANDON_POLL_S = 0.1  # how often a round in progress checks whether anyone is left to average with
RETRY_PAUSES_S = (0.05, 0.1, 0.2, 0.4, 0.8)  # after the 1st, 2nd, ... failed attempt of a round (then the last)
# attempts of a probe: a member still in the round before (the stage's gradient round) refuses a probe's part at once,
# and one whose digest differs makes a retry fail as fast (it has begun the parameter round by then)
PROBE_ATTEMPTS = 2
PARAM_ROUND_GATHERS = 3  # a parameter round's attempts begin within this many gather times (`Rounds.gather_timeout`)

logger = logging.getLogger(__name__)


def butterfly_bytes(codec: Codec, numel: int, dtype: torch.dtype, group: int) -> int:
    """Bytes one peer sends in a butterfly all-reduce of `numel` values over `group` peers (it receives as many): the
    (group-1)/group of its tensor that other peers reduce, then its own reduced part to each of them. What the
    peers' daemons send over TCP is within 1% of this in a fixed group (tests/benchmarks/bench_socket_bytes.py)."""
    return int(2 * codec.encoded_bytes(numel, dtype) * (group - 1) / group)


class Rounds:
    """All-reduce rounds of one averager, each retried within --averaging-timeout (`_run`): what gradient and
    parameter averaging share. Compute thread or averaging pool."""

    attempt_log_level = logging.WARNING  # of an attempt that failed (the round may still succeed)

    def gather_timeout(self) -> float:
        """How long an attempt in a fixed group waits for every member to begin sending before it fails: the peers
        of a stage end an epoch within moments of each other."""
        return self.cfg.matchmaking_time

    def __init__(self, averager: StrictAverager, cfg: AveragingConfig, codec: Codec):
        self.averager, self.cfg, self.codec = averager, cfg, codec
        self.members: Callable[[], Iterable[str]] | None = None  # libp2p ids our groups may hold (None: anyone)
        # the epoch -> the most each member's part may weigh in the parts we reduce, by libp2p id (None: no cap but
        # the averager's own); a member it does not name weighs nothing there
        self.weight_caps: Callable[[int], dict[str, float]] | None = None
        self.bytes = 0  # what this peer sent and received, from the encoded size of what it handed hivemind
        self.fp32_bytes = 0  # what the same rounds of whole fp32 tensors would have sent and received
        self.rounds_ok = self.rounds_failed = 0
        self.last_group_size = 0  # peers in the last round that succeeded, us included
        self.last_group: frozenset[str] = frozenset()  # ... and their libp2p ids

    def _run(
        self,
        fill: Callable[[list[torch.Tensor]], None],
        n_samples: int,
        label: str,
        gather: list,
        numel: tuple[int, int],
        finished_without_us: Callable[[], bool],
        retry_grace: float,
        nobody_left: Callable[[], bool],
        group_size: int | None = None,
        group: Callable[[], list[str] | None] | None = None,
        *,
        probe: bool = False,
        budget: float | None = None,
    ) -> bool:
        """Rounds until one succeeds (True) or the timeout; `fill` writes our part into the averager's buffers.
        `gather` (epoch, phase, scheme) travels with our part: peers whose parts would not add up never average.
        `numel`: (values sent, values of the whole tensors), for the byte counts. `probe`: PROBE_ATTEMPTS attempts,
        whose failure is an answer rather than a failed round (not counted, logged at DEBUG); it fails unless the
        whole group it expected (`group_size`) took part. `budget`: seconds in which attempts may begin (by default
        --averaging-timeout)."""
        started = time.monotonic()
        result, failures = None, 0

        def remaining() -> float:
            return (self.cfg.averaging_timeout if budget is None else budget) - (time.monotonic() - started)

        def give_up() -> bool:
            return remaining() <= 0 or finished_without_us() or nobody_left() or self.averager.closing

        while result is None and not give_up():
            # every attempt in the fixed group of the peers the stage knows now, if it knows one beyond us: a member
            # that is gone leaves that view within --peer-timeout (its Progress fails), and peers whose views differ
            # meet once they agree. Matchmaking only without one: it reads the DHT, and while a frozen peer's DHT node
            # held those reads, matchmade retries of two healthy peers found no group for 10 s (the soak)
            fixed = group() if group is not None else None  # first: it may read who the members are afresh
            members = None if self.members is None else self.members()
            self.averager.expect_group(group_size if self.cfg.early_rounds else None, members)
            if self.weight_caps is not None:  # what each peer's admissions prove it holds, as of now (served.py)
                self.averager.cap_weights(self.weight_caps(gather[0]))
            if group is not None:
                self.averager.fix_group(fixed or None, gather_timeout=self.gather_timeout())
            with self.averager.get_tensors() as buffers:  # every attempt starts from our own gradients
                fill(buffers)
            try:
                control = self.averager.step(
                    weight=float(n_samples),
                    scheduled_time=get_dht_time() + self.cfg.matchmaking_time,
                    timeout=self.cfg.averaging_timeout,
                    allow_retries=False,
                    gather=gather,
                    wait=False,
                )
            except AveragerClosed:
                logger.info("%s: not averaged: the peer is shutting down", label)
                return False
            try:  # the step's own timeout covers matchmaking only: bound the round, or a stuck peer stalls the stage
                result = round_result(control, self.averager, self.cfg.averaging_timeout, nobody_left)
            except Exception as e:
                control.cancel()
                logger.log(logging.DEBUG if probe else self.attempt_log_level, "all-reduce attempt failed: %r", e)
                if probe and failures + 1 >= PROBE_ATTEMPTS:
                    return False
                # A round can end for our peers and fail for us. Their report of the next epoch arrives within a
                # round trip; a retry without them would wait the whole --averaging-timeout for a group.
                # Do not start one and cancel it instead: hivemind may still run a cancelled step with a later group.
                grace = time.monotonic() + retry_grace
                while time.monotonic() < grace and not finished_without_us():
                    time.sleep(0.01)
                # and back off: a retry that fails at once (a fixed group whose other member moved on) would
                # otherwise go again at once; with delayed steps, where nothing tells us a round ended for our peers,
                # one peer ran 505 attempts in 10 s, each logging hivemind's traceback
                failures += 1
                if not give_up():
                    time.sleep(min(RETRY_PAUSES_S[min(failures, len(RETRY_PAUSES_S)) - 1], max(0.0, remaining())))
        if result is None:
            if not probe:
                logger.warning("%s: all-reduce failed", label)
                self.rounds_failed += 1
            return False
        tags = sorted({repr(tag) for tag in result.values()})
        if tags != [repr(gather)]:  # also refused in the averager's process, before anything is sent
            logger.warning("%s: the group averaged rounds %s together: treated as a failed round", label, tags)
            self.rounds_failed += not probe
            return False
        self.bytes += butterfly_bytes(self.codec, numel[0], torch.float32, len(result))
        self.fp32_bytes += butterfly_bytes(get_codec("none"), numel[1], torch.float32, len(result))
        if probe:  # (a matchmade group may hold fewer: the rest did not take part, and would average alone)
            return group_size is None or len(result) >= group_size
        self.rounds_ok += 1
        self.last_group_size = len(result)
        self.last_group = frozenset(str(peer) for peer in result)
        logger.info(
            "%s: averaged %d samples with %d peers in %.2fs", label, n_samples, len(result), time.monotonic() - started
        )
        return True

    def _average_whole(
        self,
        tensors: list[torch.Tensor],
        weight: int,
        label: str,
        gather: list,
        waits: tuple,
        budget: float | None = None,
    ) -> list[torch.Tensor] | None:
        """The group's average of `tensors` (the averager's own buffers' shapes), whole; None if the round failed or
        returned non-finite values. `waits`: `_run`'s (finished_without_us, retry_grace, nobody_left, group_size,
        group)."""

        def fill(buffers: list[torch.Tensor]) -> None:
            for buf, t in zip(buffers, tensors, strict=True):
                buf.copy_(t)

        numel = sum(t.numel() for t in tensors)
        if not self._run(fill, weight, label, gather, (numel, numel), *waits, budget=budget):
            return None
        with self.averager.get_tensors() as buffers:
            averaged = [b.clone() for b in buffers]
        return averaged if self._finite(averaged, label) else None

    @staticmethod
    def _finite(averaged: list[torch.Tensor], label: str) -> bool:
        if all(bool(torch.isfinite(a).all()) for a in averaged):
            return True
        # a group whose weights sum to 0 (nobody had samples) averages 0/0; anything else non-finite is garbage
        logger.warning("%s: the all-reduce returned non-finite values: treated as a failed round", label)
        return False


def round_result(
    control: StepControl, averager: StrictAverager, timeout: float, nobody_left: Callable[[], bool] = lambda: False
) -> dict | None:
    """A round's result, within twice `timeout` (the step's own timeout covers matchmaking only); at once an error
    once `nobody_left()` or once the averager is shutting down (a stopping peer's round ends with it)."""
    deadline = time.monotonic() + 2 * timeout
    while True:
        try:
            return control.result(timeout=min(ABANDON_POLL_S, max(0.0, deadline - time.monotonic())))
        except TimeoutError:
            if nobody_left():
                raise AllreduceException("every peer of the stage stopped answering") from None
            if averager.closing:
                raise AveragerClosed("the peer is shutting down") from None
            if time.monotonic() >= deadline:
                raise


class GradientAveraging(Rounds):
    """A weighted all-reduce of one epoch's mean gradients (weight: samples behind them)."""

    averager: StageAverager

    def average(
        self,
        grads: list[torch.Tensor],
        n_samples: int,
        label: str,
        round_tag: int,
        finished_without_us: Callable[[], bool] = lambda: False,
        retry_grace: float = 0.0,
        nobody_left: Callable[[], bool] = lambda: False,
        group_size: int | None = None,
        group: Callable[[], list[str] | None] | None = None,
    ) -> list[torch.Tensor] | None:
        """The group's average, or None if the round failed, or if `finished_without_us()` (a round that ended for
        every other peer and not for us: nobody is left to retry with). After a failed attempt, wait up to
        `retry_grace` seconds for that to become known before retrying. Once `nobody_left()` (every peer of the
        stage stopped answering: dead or frozen), the round fails at once instead of waiting out its timeout for
        them, which would hold the compute thread and the trainers' calls. `round_tag` (the epoch) travels with our
        part: hivemind's matchmaking groups whoever is looking at the time, so with delayed steps one peer's round
        for epoch e could meet another's for e + 1; a group whose tags differ is a failed round for all of them.
        `group_size`: the peers in the round as the stage knows them, us included; the round begins once that many
        have gathered instead of after --matchmaking-time (a peer we did not count fails this round and resyncs).
        `group`: with --fixed-groups, returns the libp2p ids of the other peers in the round: they alone make the
        group of the first attempt, with no matchmaking (None, or None or [] returned: matchmaking)."""

        gather = [round_tag, PHASE_FULL, self.cfg.scheme]
        waits = (finished_without_us, retry_grace, nobody_left, group_size, group)
        return self._average_whole(grads, n_samples, label, gather, waits)


class LowRankGradientAveraging(GradientAveraging):
    """Low-rank averaging (see server/collab/lowrank.py): after --allreduce-warmup-epochs of whole gradients, each
    epoch averages one factor of each low-rank tensor (ACP-SGD) or both in two rounds (PowerSGD). A failed round
    changes neither the factors nor the error feedback."""

    def __init__(self, averager: StageAverager, cfg: AveragingConfig, codec: Codec, lowrank: LowRankState):
        super().__init__(averager, cfg, codec)
        self.lowrank = lowrank

    def average(
        self,
        grads: list[torch.Tensor],
        n_samples: int,
        label: str,
        round_tag: int,
        finished_without_us: Callable[[], bool] = lambda: False,
        retry_grace: float = 0.0,
        nobody_left: Callable[[], bool] = lambda: False,
        group_size: int | None = None,
        group: Callable[[], list[str] | None] | None = None,
    ) -> list[torch.Tensor] | None:
        waits = (finished_without_us, retry_grace, nobody_left, group_size, group)
        if round_tag < self.cfg.allreduce_warmup_epochs:
            return super().average(grads, n_samples, label, round_tag, *waits)
        epoch = self._power_sgd if isinstance(self.lowrank, PowerSgdState) else self._acp
        averaged = epoch(grads, n_samples, label, round_tag, waits)
        if averaged is None:
            return None
        low_rank, whole = averaged
        merged = {**dict(zip(self.lowrank.layout.matrices, low_rank, strict=True)), **whole}
        return [merged[i] for i in range(len(grads))]

    def _acp(
        self, grads: list[torch.Tensor], n_samples: int, label: str, round_tag: int, waits: tuple
    ) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]] | None:
        """An ACP-SGD epoch: one round of one factor; (averaged low-rank gradients, whole tensors) or None."""
        state = self.lowrank
        assert isinstance(state, AcpState)
        rnd = state.compress(grads, round_tag, float(n_samples))
        averaged = self._factors_round(rnd.phase, rnd.factors, grads, n_samples, label, round_tag, waits)
        if averaged is None:
            return None
        averaged_factors, whole = averaged
        low_rank = state.decompress(rnd, averaged_factors, [g.shape for g in grads])
        state.commit(rnd, averaged_factors, had_samples=n_samples > 0)
        return low_rank, whole

    def _power_sgd(
        self, grads: list[torch.Tensor], n_samples: int, label: str, round_tag: int, waits: tuple
    ) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]] | None:
        """Both rounds of a PowerSGD epoch; either failing fails the epoch and commits nothing."""
        state = self.lowrank
        assert isinstance(state, PowerSgdState)
        rnd = state.first(grads, round_tag, float(n_samples))
        first = self._factors_round(PHASE_PSGD_P, rnd.factors, grads, n_samples, label, round_tag, waits)
        if first is None:
            return None
        averaged_p, whole = first
        rnd = state.second(rnd, averaged_p)
        second = self._factors_round(PHASE_PSGD_Q, rnd.factors, grads, n_samples, label, round_tag, waits)
        if second is None:
            return None
        return state.finish(rnd, second[0], [g.shape for g in grads], n_samples > 0), whole

    def _factors_round(
        self,
        phase: str,
        factors: list[torch.Tensor],
        grads: list[torch.Tensor],
        n_samples: int,
        label: str,
        round_tag: int,
        waits: tuple,
    ) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]] | None:
        """One round of `phase`: our factors (and the whole tensors, unless PowerSGD's second round) averaged with the
        group; (averaged factors, {index: averaged whole tensor}), or None if the round failed."""
        layout, shapes = self.lowrank.layout, [g.shape for g in grads]
        with_whole = phase != PHASE_PSGD_Q
        buffers_of_factors = self.averager.factors[PHASE_P if phase in (PHASE_P, PHASE_PSGD_P) else PHASE_Q]

        def fill(buffers: list[torch.Tensor]) -> None:
            for buf, f in zip(buffers_of_factors, factors, strict=True):
                buf.copy_(f)
            if with_whole:
                for i in layout.whole:
                    buffers[i].copy_(grads[i])

        numel = (layout.sent_numel(phase, shapes), sum(g.numel() for g in grads) if with_whole else 0)
        gather = [round_tag, phase, self.cfg.scheme]
        if not self._run(fill, n_samples, label, gather, numel, *waits):
            return None
        with self.averager.get_tensors() as buffers:
            averaged_factors = [f.clone() for f in buffers_of_factors]
            whole = {i: buffers[i].clone() for i in layout.whole} if with_whole else {}
        if not self._finite([*averaged_factors, *whole.values()], label):
            return None
        return averaged_factors, whole


class ParameterAveraging(Rounds):
    """A plain mean of the peers' parameters (weight 1 each), every --param-average-every epochs: pulls together peers
    whose optimizers round differently (devices of different kinds), which identical averaged gradients alone do not
    keep equal. Peers on one kind of device hold bitwise-equal parameters already: a probe round first (a few values)
    learns whether every member of the group holds the same parameters, and then nothing is averaged. Compute
    thread."""

    averager: StageAverager

    def __init__(self, averager: StageAverager, cfg: AveragingConfig, codec: Codec):
        super().__init__(averager, cfg, codec)
        self.rounds_skipped = 0  # parameter rounds that did not run: the probe found every member holding ours

    def average(
        self,
        worker: StageWorker,
        epoch: int,
        group_size: int | None = None,
        group: Callable[[], list[str] | None] | None = None,
        nobody_left: Callable[[], bool] = lambda: False,
    ) -> None:
        """Replaces the worker's parameters with the group's mean; keeps them if the round fails. `group_size`,
        `group`, `nobody_left`: as GradientAveraging.average's."""
        label = f"stage parameters at epoch {epoch}"
        params = worker.stage_params
        waits = (lambda: False, 0.0, nobody_left, group_size, group)
        if self.cfg.param_average_probe:

            def fill_probe(buffers: list[torch.Tensor]) -> None:
                pass  # the probe averages values of its own (StageAverager.probe)

            gather = [epoch, PHASE_DIGEST, state_digest(params)]
            if self._run(fill_probe, 1, label, gather, (PROBE_TENSORS,) * 2, *waits, probe=True):
                self.rounds_skipped += 1
                logger.info("%s: every peer of the group holds the same parameters: nothing to average", label)
                return

        # attempts begin within a few gather times: the members are in the round together, or one of them is not
        # (its probe succeeded where ours failed, and it went on: alone we would hold the compute thread, and refuse
        # the members' next gradient parts, for the whole --averaging-timeout)
        budget = PARAM_ROUND_GATHERS * self.gather_timeout()
        gather = [epoch, PHASE_PARAMS, self.codec.name]
        averaged = self._average_whole([p.detach() for p in params], 1, label, gather, waits, budget)
        if averaged is None:
            return
        with worker.changing_state(), torch.no_grad():
            for p, a in zip(params, averaged, strict=True):
                p.copy_(a)
