"""The stage's compute: one thread owns the module and optimizer; the event loop only submits work to it.

Requests run one at a time in arrival order, so a backward and an optimizer step never interleave. Gradients of each
microbatch are added to `.grad` weighted by its sample count; `take_gradients` turns the sum into a mean and starts a
new accumulation, `apply_gradients` clips, steps and bumps `param_version`. When to do either is decided elsewhere
(server/collab/): alone, or after averaging with the stage's other peers.

The worker also holds the stage's `epoch` (global batches this peer has finished accumulating). Its one writer is the
compute thread, always under `state_lock` together with the parameters, so a state sent to a joining peer carries the
epoch that belongs to its parameters.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch

from server.accumulation import Accumulation
from server.compute import ComputeThread, DeadlineExpired, Timing
from server.config import ComputeConfig, GuardConfig, OptimizerConfig
from server.guard import GradientGuard, GradientRejected, all_finite, total_norm
from server.optim import MOMENTS, beyond_steps, build_optimizer, build_schedule
from server.outer import OuterState
from server.state import (
    INITIAL_LINEAGE,
    StateChecks,
    parse_state,
    split_outer,
    state_digest,
    state_view,
    valid_lineage,
)
from swarm.model import Stage, clip_gradients
from swarm.pipeline import BackwardResult, stage_backward, stage_forward
from swarm.protocol.tensors import WireError, check_values

logger = logging.getLogger(__name__)
FORWARD_CHUNK_CPU = 16  # samples per piece of a Forward on CPU (--forward-chunk-samples -1)
R = TypeVar("R")
PRIOR_UNTIL = 16  # microbatches measured before a moved peer reports its own speed on the new stage


class StageWorker:
    def __init__(
        self,
        stage: Stage,
        optimizer: OptimizerConfig,
        compute: ComputeConfig,
        device: torch.device,
        prior_throughput: float = 0.0,
        guard: GuardConfig | None = None,
    ):
        """`prior_throughput` > 0: what `throughput` reports until PRIOR_UNTIL microbatches of this stage are measured
        (a peer that moved brings its speed on its previous stage instead of a fresh, noisier, one-off measurement)."""
        self.stage, self.device = stage.to(device).train(), device
        self.optim_cfg, self.compute_cfg = optimizer, compute
        chunk = compute.forward_chunk_samples
        self.forward_chunk = chunk if chunk >= 0 else (FORWARD_CHUNK_CPU if device.type == "cpu" else 0)
        self.prior_throughput = prior_throughput
        self.guard_cfg = guard or GuardConfig()
        self.guard = GradientGuard(self.guard_cfg.grad_outlier_factor)
        self.steps_skipped = 0  # averaged gradients that were not finite: no step
        self.steps_rolled_back = 0  # steps that left a parameter non-finite: undone
        self.params = [p for p in stage.parameters() if p.requires_grad]
        # tied embeddings: our copy of the weight shared with another stage, averaged over both stages' peers, and the
        # index of its gradient in `take_gradients`'s list; the stage's own all-reduce averages `stage_params`
        self.tied = stage.tied_weight
        self.tied_index = next((i for i, p in enumerate(self.params) if p is self.tied), None)
        self.stage_params = [p for p in self.params if p is not self.tied]
        self.optimizer = build_optimizer(optimizer.optimizer, self.params, optimizer.lr, optimizer.weight_decay)
        self.schedule = build_schedule(self.optimizer, optimizer.warmup_steps, optimizer.total_steps)
        self.state_lock = threading.Lock()  # parameters and optimizer state change only under it (`changing_state`)
        self._generation = 0  # bumped by every `changing_state`: what the cached digest belongs to
        self._digested: tuple[int, tuple[int, str]] | None = None  # (generation, `digest()`)
        # tensors shared with the state (the stage's low-rank factors): the source, and its copy read at the last change
        self._shared_source: Callable[[], list[torch.Tensor]] | None = None
        self._shared_copy: list[torch.Tensor] = []
        self.checks = StateChecks(
            self.params, self.optimizer, self.schedule, self.state_lock, optimizer, self.tied_index, self.guard
        )
        self.compute = ComputeThread(f"stage{stage.index}-compute")
        self.queue_length = 0
        self.param_version = 0  # optimizer steps taken
        self.epoch = 0  # global batches finished; ahead of param_version by a pending delayed step or stepless epochs
        # where our parameters come from: every peer that starts from the shared seed holds the same ones; a step
        # alone starts a history of our own (`branch`), and a downloaded state brings its donor's
        self.lineage = INITIAL_LINEAGE
        self.samples_processed = 0
        self.accumulated = Accumulation(self.params)  # this epoch's gradients and the next's (accumulation.py)
        # the parameters of the last few versions (--stash-versions), so that a backward whose forward ran before a
        # step recomputes that forward at the parameters that produced its outputs: a gradient of one model
        self._stash: dict[int, list[torch.Tensor]] = {}
        self.backwards_at_stashed_version = 0  # microbatches whose forward ran before a step, recomputed as it ran
        self.backwards_past_stash = 0  # ... whose version was no longer kept: recomputed at the current parameters
        self.microbatches_processed = 0
        self.timing = Timing(device, compute.slowdown)
        # local-step training (`enable_local_steps`): the outer state, and our samples since our last inner step
        self.outer: OuterState | None = None
        self.local_batch = self.max_inner_steps = 0
        self._local_samples = 0
        self.inner_steps = 0

    def enable_local_steps(
        self, local_batch: int, outer_lr: float, outer_momentum: float, max_inner_steps: int
    ) -> None:
        """Before serving, once: local-step training (server/outer.py). Every `local_batch` of our own samples our
        optimizer steps on their mean gradient (an inner step); the stage's epochs end in an outer round instead of a
        gradient round (`pseudo_gradients`, `outer_step`). What we share with a joiner is then the outer state and our
        inner optimizer's (`_state_view`). `max_inner_steps`: the most inner steps a peer can take in one interval;
        an outer round's average that moves further than they can is refused (`outer_step`)."""
        if self.tied is not None:
            raise ValueError("local-step training (--local-batch) does not support --tie-embeddings yet")
        with self.changing_state():
            self.outer = OuterState(self.params, outer_lr, outer_momentum)
            self.local_batch, self.max_inner_steps = local_batch, max_inner_steps

    async def submit(self, fn: Callable[[], R], deadline: float | None = None, request: bool = False) -> R:
        """Run `fn` on the compute thread: a `request` (Forward, Backward) after those before it, anything else before
        every waiting request. Raises DeadlineExpired instead of running it if `deadline` (monotonic) passed. The job
        is queued before this first yields (epoch.py's calls that wait for a step's job rely on it): await nothing
        before `compute.submit`."""

        def guarded() -> R:
            if deadline is not None and time.monotonic() > deadline:
                raise DeadlineExpired
            return fn()

        self.queue_length += request
        try:
            return await asyncio.wrap_future(self.compute.submit(guarded, control=not request))
        finally:
            self.queue_length -= request

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Compute thread only. In pieces of `forward_chunk` samples, each written into the output as it is done:
        every sample's output depends on that sample alone (no layer mixes the batch), so the output is the same,
        and the working memory is a piece's (a server's resident memory under a burst of Forwards, bench_flood)."""
        n, chunk = inputs.shape[0], self.forward_chunk
        with self.timing.timed("forward", n):
            if not 0 < chunk < n:
                return stage_forward(self.stage, inputs)
            first = stage_forward(self.stage, inputs[:chunk])
            out = first.new_empty((n, *first.shape[1:]))
            out[:chunk] = first
            for start in range(chunk, n, chunk):
                out[start : start + chunk] = stage_forward(self.stage, inputs[start : start + chunk])
            return out

    def backward(
        self,
        inputs: torch.Tensor,
        grad_outputs: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        forward_version: int | None = None,
        global_batch: int | None = None,
        admission: object | None = None,
        caller: str = "",
    ) -> BackwardResult:
        """Compute thread only. Adds this microbatch's gradients to the epoch's, or to the next epoch's if it belongs
        to a later `global_batch` (admitted early). A microbatch of an earlier global batch (late: the epoch ended
        without it) joins the current epoch's gradients without counting towards its end. `forward_version`: the
        param_version that served this microbatch's forward; the recomputed forward uses those parameters if they
        are stashed. `admission`: stage 0's of this microbatch, kept with the count it goes to (`served`). `caller`: who
        sent it (the gradient guard keeps each caller's norms apart)."""
        n = inputs.shape[0]
        early = global_batch is not None and global_batch > self.epoch
        late = global_batch is not None and global_batch < self.epoch
        stashed = None
        if forward_version is not None and forward_version != self.param_version:
            stashed = self._stash.get(forward_version)
            if stashed is None:
                self.backwards_past_stash += 1
            else:
                self.backwards_at_stashed_version += 1
        # local steps: every gradient goes to the next inner step, whichever epoch counts its samples
        into_next = self.accumulated.into_next(early and self.outer is None)
        with self.timing.timed("backward", n), self._parameters(stashed), into_next:
            result = stage_backward(
                self.stage,
                inputs,
                grad_outputs=grad_outputs,
                labels=labels,
                grad_weight=n,
                accept=functools.partial(self._accept, caller=caller),
            )
        self.samples_processed += n
        self.accumulated.add(n, early, late, admission)
        self.microbatches_processed += 1
        if self.outer is not None:
            self._local_samples += n
            if self._local_samples >= self.local_batch:
                self.inner_step()
        return result

    @torch.no_grad()
    def inner_step(self) -> None:
        """Compute thread, local steps: one step of our optimizer on the mean gradient of our samples since the last
        one (none: nothing to do). Clipped, skipped if not finite and rolled back if it leaves parameters non-finite,
        as any step (`_checked_step`)."""
        k, self._local_samples = self._local_samples, 0
        if k == 0:
            return
        # the state lock alone, not `changing_state`: the digest covers the outer state, which an inner step leaves as
        # it is, so the cached digest stays valid (hashing the outer state again after every inner step would cost
        # seconds under the lock for a large stage at every Info that asks for it)
        with self.state_lock:
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(k)
            try:
                self._checked_step()
            finally:
                for p in self.params:
                    p.grad = None
        self.inner_steps += 1

    def pseudo_gradients(self) -> tuple[list[torch.Tensor], int]:
        """Compute thread, local steps, as the epoch ends: an inner step on what is left, then (the outer parameters
        minus ours, the samples of the epoch behind them: the weight of our part in the outer round)."""
        assert self.outer is not None, "pseudo_gradients: local steps are not enabled"
        self.inner_step()
        with self.state_lock:
            return self.outer.pseudo_gradients(self.params), self.accumulated.samples + self.accumulated.samples_late

    @torch.no_grad()
    def outer_step(self, averaged: Sequence[torch.Tensor]) -> None:
        """Compute thread, local steps: the epoch's outer step on the stage's average of the pseudo-gradients (ours
        alone when we are alone), which ends the epoch; our parameters become the new outer ones. An average that is
        not finite, or that moves a parameter further than `max_inner_steps` inner steps can (a peer sent what no
        inner steps make), moves nothing: every peer of the round got the same average and refuses it alike, and the
        parameters go back to the outer ones all the same."""
        assert self.outer is not None, "outer_step: local steps are not enabled"
        with self.changing_state():
            self._stash_parameters()  # a backward whose forward ran before this recomputes at those parameters
            beyond = self._beyond_inner_steps(averaged)
            if beyond is not None:
                self.steps_skipped += 1
                logger.error(
                    "stage %d: the outer round's average moves parameter %d further than %d inner steps can; no outer "
                    "step",
                    self.stage.index,
                    beyond,
                    self.max_inner_steps,
                )
            elif not self.outer.step(averaged):
                self.steps_skipped += 1
                logger.error("stage %d: the outer round's average is not finite; no outer step", self.stage.index)
            for p, o in zip(self.params, self.outer.params, strict=True):
                p.copy_(o)
            self.param_version += 1
            self.accumulated.take(self.epoch, mean=False)
            self.epoch += 1
            self.accumulated.stepped()

    def _accept(
        self, param_grads: list[torch.Tensor | None], grad_inputs: torch.Tensor | None, caller: str = ""
    ) -> None:
        """Compute thread. Raises GradientRejected for a microbatch whose gradients must not be accumulated."""
        if grad_inputs is not None:
            try:
                check_values(grad_inputs, "grad_inputs", self.guard_cfg.max_activation)
            except WireError as e:
                self.guard.rejected += 1
                raise GradientRejected(f"{e}; nothing accumulated") from e
        self.guard.check(param_grads, caller)

    @contextlib.contextmanager
    def _parameters(self, values: list[torch.Tensor] | None) -> Iterator[None]:
        """Compute thread. The module computes with `values` instead of its parameters (None: its own); gradients
        still go to the parameters' `.grad`. Under the state lock: nobody may read the parameters meanwhile."""
        if values is None:
            yield
            return
        with self.state_lock:
            live = [p.data for p in self.params]
            for p, v in zip(self.params, values, strict=True):
                p.data = v
            try:
                yield
            finally:
                for p, d in zip(self.params, live, strict=True):
                    p.data = d

    def _stash_parameters(self) -> None:
        """Compute thread, under the state lock, before the parameters change: keep the current version's."""
        if self.compute_cfg.stash_versions <= 0:
            return
        versions = sorted(self._stash)
        reuse = self._stash.pop(versions[0]) if len(versions) >= self.compute_cfg.stash_versions else None
        if reuse is None:
            self._stash[self.param_version] = [p.detach().clone() for p in self.params]
        else:
            self._stash[self.param_version] = [r.copy_(p.detach()) for r, p in zip(reuse, self.params, strict=True)]

    @property
    def samples_accumulated(self) -> int:
        """Samples towards the current epoch (any thread)."""
        return self.accumulated.samples

    @samples_accumulated.setter
    def samples_accumulated(self, n: int) -> None:
        self.accumulated.samples = n

    @property
    def samples_next(self) -> int:
        return self.accumulated.samples_next

    @property
    def samples_late(self) -> int:
        return self.accumulated.samples_late

    def take_gradients(self, end_epoch: bool = False) -> tuple[list[torch.Tensor], int]:
        """Compute thread only. -> (mean gradient per parameter, samples behind it); the next backward starts afresh.
        `end_epoch`: the next backward counts towards the next epoch (delayed steps: the step comes later)."""
        grads, n = self.accumulated.take(self.epoch)
        if end_epoch:
            with self.changing_state():
                self.epoch += 1
        return grads, n

    def taken_before(self, epoch: int) -> tuple[int | None, list]:
        """Any thread: accumulation.py `taken_before`."""
        return self.accumulated.taken_before(epoch)

    def recent_admissions(self) -> list:
        """Any thread: accumulation.py `recent_admissions`."""
        return self.accumulated.recent_admissions()

    def served_for(self, epoch: int) -> list:
        """Any thread: the admissions behind our weight in `epoch`'s round (accumulation.py `served_for`)."""
        return self.accumulated.served_for(epoch, lambda: self.epoch)

    def skip_to(self, epoch: int) -> None:
        """Compute thread only. Move on to `epoch` without a step (the epochs in between had no samples here); the
        gradients accumulated towards the current epoch carry over."""
        with self.changing_state():
            if epoch > self.epoch:
                self.accumulated.fold_next()
                self.epoch = epoch

    def drop_gradients(self) -> None:
        """Compute thread only. Forget every accumulated gradient, this epoch's and the next's."""
        self.accumulated.drop()

    def return_gradients(self, grads: list[torch.Tensor], n: int) -> None:
        """Compute thread only. Undo `take_gradients`: the epoch goes on accumulating."""
        self.accumulated.give_back(grads, n)

    @torch.no_grad()
    def apply_gradients(
        self,
        grads: Sequence[torch.Tensor | None],
        end_epoch: bool = False,
        load: dict[int, list[torch.Tensor]] | None = None,
    ) -> None:
        """Compute thread only. One optimizer step on `grads` (one per parameter, any device; None: that parameter
        does not step); `end_epoch`: this step finishes the current epoch (synchronous steps; a delayed step's epoch
        ended when its gradients were taken). `load`: parameters (by index) to take these states first (as
        `tied_state` gives them)."""
        with self.changing_state():
            for i, state in (load or {}).items():
                self._load_slots(self.params[i], state)
            saved = [p.grad for p in self.params]  # gradients of the next epoch, when steps are delayed
            try:
                for p, g in zip(self.params, grads, strict=False):
                    p.grad = None if g is None else g.to(p.device, p.dtype)
                self._checked_step()
            finally:
                for p, saved_grad in zip(self.params, saved, strict=False):
                    p.grad = saved_grad
            if end_epoch:
                self.epoch += 1
            self.accumulated.stepped()  # that epoch's round is over

    def _beyond_inner_steps(self, averaged: Sequence[torch.Tensor]) -> int | None:
        """Under the state lock: the first parameter that the outer parameters minus `averaged` put further from them
        than `max_inner_steps` steps of our optimizer can, or None (non-finite values are `OuterState.step`'s)."""
        assert self.outer is not None
        name, groups = self.optim_cfg.optimizer, self.optimizer.param_groups
        for i, (o, g) in enumerate(zip(self.outer.params, averaged, strict=True)):
            before = o.detach().cpu()
            if torch.isfinite(g).all() and beyond_steps(name, groups, before, before - g.cpu(), self.max_inner_steps):
                return i
        return None

    def tied_state(self) -> list[torch.Tensor]:
        """Any thread. Our copy of the tied weight and its optimizer state, as CPU tensors: [weight, first moment,
        second moment, step count (one value)]; zeros for those of a weight that has not stepped yet."""
        assert self.tied is not None, "tied_state: this stage holds no tied weight"
        with self.state_lock:
            weight = self.tied.detach().cpu().clone()
            slots = self.optimizer.state.get(self.tied, {})
            moments = [slots[k].detach().cpu().clone() if k in slots else torch.zeros_like(weight) for k in MOMENTS]
            return [weight, *moments, torch.tensor([float(slots.get("step", 0))])]

    def _load_slots(self, p: torch.Tensor, state: list[torch.Tensor]) -> None:
        """Under the state lock: `p` and its optimizer state take `state` (`tied_state`'s form, averaged by the peers
        of a round: finite, checked there). A step count is capped at our epochs: no copy can have stepped more."""
        weight, exp_avg, exp_avg_sq, step = state
        p.copy_(weight)
        steps = min(round(float(step.reshape(-1)[0])), self.epoch + 1)
        if steps <= 0:
            self.optimizer.state.pop(p, None)
            return
        self.optimizer.state[p] = {
            "step": torch.tensor(float(steps)),
            MOMENTS[0]: exp_avg.to(p.device, p.dtype).clone(),
            MOMENTS[1]: exp_avg_sq.to(p.device, p.dtype).clamp(min=0),
        }

    def _checked_step(self) -> None:
        """Compute thread, under the state lock, with `.grad` set: clip and step, unless the gradients are not finite
        (no step: counted in `steps_skipped`). A step that leaves a parameter non-finite is undone: the parameters
        are restored bitwise and `param_version` stays (`steps_rolled_back`); the optimizer's moments keep that
        step's finite gradient. Same inputs, same outcome: peers that apply one average stay equal either way."""
        clip = self.optim_cfg.clip_grad_norm
        # one pass over the gradients: clipping measures their norm anyway (and scales them to NaN if it is not finite)
        norm = clip_gradients(self.params, clip, self.tied) if clip > 0 else total_norm([p.grad for p in self.params])
        if not math.isfinite(norm):
            self.steps_skipped += 1
            logger.error("stage %d: gradients to apply are not finite (norm %s); no step", self.stage.index, norm)
            return
        self._stash_parameters()
        before = self._stash.get(self.param_version) or [p.detach().clone() for p in self.params]
        self.optimizer.step()
        self.schedule.step()
        if all_finite(self.params):
            self.param_version += 1
            return
        with torch.no_grad():
            for p, b in zip(self.params, before, strict=True):
                p.copy_(b)
        self.steps_rolled_back += 1
        logger.error(
            "stage %d: a step left parameters non-finite (lr %s); rolled back to version %d",
            self.stage.index,
            self.optimizer.param_groups[0]["lr"],
            self.param_version,
        )

    @contextlib.contextmanager
    def changing_state(self) -> Iterator[None]:
        """The state lock, for code that changes the parameters, the optimizer's state or the epoch: every such
        change goes through here, which tells `digest` that its cached value is stale."""
        with self.state_lock:
            try:
                yield
            finally:
                self._generation += 1  # first: the cached digest is stale even if reading the shared tensors fails
                if self._shared_source is not None:
                    self._shared_copy = self._shared_source()

    def share_with_state(self, source: Callable[[], list[torch.Tensor]]) -> None:
        """Any thread, once: tensors that a peer downloading our state gets with it and that its digest covers (the
        stage's low-rank factors, server/collab/lowrank.py). `source()` returns copies; it is read at every change of
        the state (`changing_state`), so the copy shared is the one that goes with the parameters it was read with:
        a round's factors are kept before the step they belong to, and a state and its factors read at different
        moments between the two would pair factors of one epoch with parameters of the one before. Not under the
        state lock (it is not reentrant)."""
        with self.changing_state():
            self._shared_source = source

    def digest(self) -> tuple[int, str]:
        """Any thread. (epoch, `state_digest`) of the state a peer downloading ours gets (`state_tensors`), both of
        one snapshot: hashed under the state lock, a tensor at a time, without a copy of the whole state (anyone
        may ask for a digest: a copy each made a burst of them hold that many states). Hashed once per state: until
        the state changes (`changing_state`) the same digest is returned without reading it (a 1B-parameter stage's
        took 2.5 s under the lock, during which no step can start)."""
        with self.state_lock:
            if self._digested is not None and self._digested[0] == self._generation:
                return self._digested[1]
            meta, tensors = self._shared_view()
            digest = int(meta["epoch"]), state_digest(tensors, meta)
            self._digested = self._generation, digest
            return digest

    def state_tensors(self) -> tuple[dict, list[torch.Tensor]]:
        """Any thread. Parameters and optimizer state as (metadata, CPU tensors), consistent with each other."""
        meta, tensors, _ = self.state_and_shared()
        return meta, tensors

    def state_and_shared(self) -> tuple[dict, list[torch.Tensor], list[torch.Tensor]]:
        """Any thread. `state_tensors` and the tensors shared with that state (copies), of one snapshot: what a
        checkpoint saves."""
        with self.state_lock:
            meta, tensors = self._state_view()
            # one copy, from a GPU too
            return meta, [t.to("cpu", copy=True) for t in tensors], [t.clone() for t in self._shared_copy]

    def shared_state(self) -> tuple[dict, list[torch.Tensor], str]:
        """Any thread. What a joiner downloads: `state_tensors`, then the tensors shared with the state (`lowrank` in
        the metadata counts them), and their `state_digest`: the cached digest while the state has not changed,
        else one hashed from the copies, outside the lock, and cached for `digest` if the state is still the same."""
        with self.state_lock:
            generation, cached = self._generation, self._digested
            meta, tensors = self._shared_view()
            tensors = [t.to("cpu", copy=True) for t in tensors]
        if cached is not None and cached[0] == generation:
            return meta, tensors, cached[1][1]
        digest = state_digest(tensors, meta)
        with self.state_lock:
            if self._generation == generation:
                self._digested = generation, (int(meta["epoch"]), digest)
        return meta, tensors, digest

    def _shared_view(self) -> tuple[dict, list[torch.Tensor]]:
        """Under the state lock: `_state_view` and the tensors shared with the state, as `shared_state` gives them."""
        meta, tensors = self._state_view()
        if self._shared_source is None:
            return meta, tensors
        return {**meta, "lowrank": len(self._shared_copy)}, [*tensors, *self._shared_copy]

    def _state_view(self) -> tuple[dict, list[torch.Tensor]]:
        """Under the state lock: `state_tensors`' metadata, and its tensors as they live (not copied). With local
        steps: the outer parameters in place of ours, our inner optimizer's state, then the outer momentum (`outer` in
        the metadata: the digest covers the outer state alone, which every peer of the stage holds alike)."""
        if self.outer is None:
            return state_view(self.params, self.optimizer, self.schedule, self.param_version, self.epoch, self.lineage)
        outer = self.outer
        meta, tensors = state_view(
            outer.params, self.optimizer, self.schedule, self.param_version, self.epoch, self.lineage
        )
        return {**meta, "outer": {"steps": outer.steps}}, [*tensors, *outer.momentum()]

    def load_state(self, meta: dict, tensors: list[torch.Tensor], with_state: Callable[[], None] | None = None) -> None:
        """Compute thread (or before serving). Inverse of `state_tensors`; raises ValueError on a mismatch, changing
        nothing. `with_state`: loads what is shared with the state (the downloaded state's low-rank factors) in the
        same change, once the state is checked and loaded, so that no reader sees the new parameters with the old
        factors (nor the new factors beside our parameters if the state is refused)."""
        tensors, outer = split_outer(meta, tensors, self.params, local=self.outer is not None)
        params, state, schedule = self._parsed(meta, tensors)
        with self.changing_state(), torch.no_grad():
            self._stash.clear()  # versions of another history: a backward that names one is recomputed as of now
            for p, t in zip(self.params, params, strict=True):
                p.copy_(t)
            if self.outer is not None and outer is not None:  # our inner steps begin again from the outer state
                self.outer.load(params, *outer)
                self._local_samples = 0
            self.optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
            self.schedule.load_state_dict(schedule)
            self.param_version = int(meta["param_version"])
            self.epoch = int(meta.get("epoch", self.param_version))
            lineage = meta.get("lineage")  # a state without one (an older checkpoint) has a history of its own
            self.lineage = lineage if valid_lineage(lineage) else secrets.token_hex(8)
            if with_state is not None:
                with_state()

    def _parsed(self, meta: dict, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[int, dict], dict]:
        """A downloaded state checked against ours (state.py `parse_state`): raises ValueError unless it fits."""
        return parse_state(meta, tensors, self.params, self.optimizer, self.schedule)

    def branch(self) -> None:
        """Compute thread: we stepped alone; from now on our parameters have a history no peer shares."""
        self.lineage = secrets.token_hex(8)

    @property
    def throughput(self) -> float:
        """Training samples/s this peer sustains: one forward plus one backward (with recompute) per sample."""
        if self.prior_throughput > 0 and self.microbatches_processed < PRIOR_UNTIL:
            return self.prior_throughput
        # the last stage gets no Forward calls: its backward computes the loss
        kinds = ("backward",) if self.stage.is_last else ("forward", "backward")
        seconds = self.timing.seconds_per_sample
        if any(k not in seconds for k in kinds):
            return 0.0
        return 1.0 / sum(seconds[k] for k in kinds)

    def calibrate(self, batch_size: int, tries: int = 5) -> None:
        """Compute thread, before serving: time the work of a random microbatch, so that the announced throughput
        means something before the first request (the rebalancer and `--stage auto` read it). Keeps the fastest of
        `tries` per kind of work: the first pays for warm-up, and on a shared machine a peer that starts next to
        others is slowed by them at random. Leaves no gradient and counts no sample."""
        cfg, index = self.stage.cfg, self.stage.index
        shape = (batch_size, cfg.max_seq_len)
        fastest: dict[str, float] = {}
        for _ in range(tries):
            self.timing.seconds_per_sample.clear()
            if index == 0:
                inputs = torch.randint(0, cfg.vocab_size, shape, device=self.device)
            else:
                inputs = torch.randn(*shape, cfg.boundary_width, device=self.device)
            if self.stage.is_last:
                self.backward(inputs, labels=torch.randint(0, cfg.vocab_size, shape, device=self.device))
            else:
                self.backward(inputs, grad_outputs=torch.randn_like(self.forward(inputs)))
            for p in self.params:
                p.grad = None
            for kind, seconds in self.timing.seconds_per_sample.items():
                fastest[kind] = min(seconds, fastest.get(kind, seconds))
        self.timing.seconds_per_sample = fastest
        self.samples_processed = self.microbatches_processed = 0
        self.accumulated.drop()
        self.guard.reset()  # random inputs: their gradients say nothing about real ones

    def shutdown(self) -> None:
        self.compute.shutdown()
