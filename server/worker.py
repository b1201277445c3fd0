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
import hashlib
import json
import logging
import math
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, TypeGuard, TypeVar

import torch

from server.config import ComputeConfig, GuardConfig, OptimizerConfig
from server.guard import GradientGuard, GradientRejected, all_finite, total_norm
from server.optim import MOMENTS, build_optimizer, build_schedule, not_within_drift, not_within_steps, replay_step
from swarm.devices import synchronize
from swarm.model import Stage, clip_gradients
from swarm.pipeline import BackwardResult, stage_backward, stage_forward
from swarm.protocol.tensors import WireError, check_values

logger = logging.getLogger(__name__)
INITIAL_LINEAGE = "init"
_LINEAGE = re.compile(r"init|[0-9a-f]{16}")


def valid_lineage(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and _LINEAGE.fullmatch(value) is not None


R = TypeVar("R")
PRIOR_UNTIL = 16  # microbatches measured before a moved peer reports its own speed on the new stage


def _digested(meta: dict) -> dict:
    """What a state's digest covers of its metadata: its epoch, the optimizer's per-tensor layout and scalars, the
    learning rates, and the schedule's position. Not what says who holds the state (its step counter, lineage), nor
    settings whose keys differ between torch versions over the same tensors (peers check those when they load)."""
    groups, schedule = meta.get("param_groups") or [], meta.get("schedule") or {}
    return {
        "epoch": meta.get("epoch"),
        "n_params": meta.get("n_params"),
        "slots": meta.get("slots"),
        "scalars": meta.get("scalars"),
        "lrs": [group.get("lr") for group in groups],
        "schedule": {key: schedule.get(key) for key in ("last_epoch", "_step_count", "base_lrs")},
    }


def state_digest(tensors: Sequence[torch.Tensor], meta: dict | None = None) -> str:
    """sha256 of a state (hex, 32 digits): the dtype, shape and bytes of every tensor and, given `meta` (as
    `StageWorker.state_tensors` returns it, or as it arrived with a downloaded state), what `_digested` takes of it.
    Equal exactly for bitwise-equal states. A peer vouches for a state with it (server/collab/recovery.py), so it
    must not be forgeable: a fingerprint of sums (as before) could be kept by a state whose values were moved
    around."""
    h = hashlib.sha256()
    if meta is not None:
        h.update(json.dumps(_digested(meta), sort_keys=True, default=repr).encode())  # tuples and lists alike
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()[:32]


RECENT_EPOCHS = 8  # epochs whose admissions `recent_admissions` keeps


def _plain(value: Any) -> Any:
    """Tuples as lists: a state that travelled through msgpack or JSON has lists where the optimizer has tuples."""
    return list(value) if isinstance(value, tuple) else value


class DeadlineExpired(Exception):
    """The caller's deadline passed while the request waited in the queue: nothing was computed."""


class ComputeThread:
    """The one thread that runs every job on a stage's module and optimizer. Requests run in arrival order; control
    jobs (ending an epoch, loading a state) run before any request still waiting, so that an epoch holds the
    gradients of exactly the backwards that ran before it ended, not of a burst queued behind its end."""

    def __init__(self, name: str):
        self._ready = threading.Condition()
        self._control: deque[tuple[Future, Callable[[], Any]]] = deque()
        self._requests: deque[tuple[Future, Callable[[], Any]]] = deque()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], R], control: bool) -> Future[R]:
        future: Future[R] = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the stage's compute thread is shut down")
            (self._control if control else self._requests).append((future, fn))
            self._ready.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._ready:
                while not (self._control or self._requests or self._closed):
                    self._ready.wait()
                if not (self._control or self._requests):
                    return
                future, fn = (self._control or self._requests).popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:
                    future.set_exception(e)

    def shutdown(self) -> None:
        """Cancels jobs that have not started; waits for the running one."""
        with self._ready:
            self._closed = True
            for future, _ in (*self._control, *self._requests):
                future.cancel()
            self._control.clear()
            self._requests.clear()
            self._ready.notify()
        self._thread.join()


# samples per piece of a Forward on CPU (--forward-chunk-samples -1)
FORWARD_CHUNK_CPU = 16


def _on_cpu(state: dict[int, dict]) -> dict[int, dict]:
    """An optimizer state by parameter index, its tensors on the CPU (a copy of those that were elsewhere)."""
    return {i: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()} for i, s in state.items()}


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
        self.compute = ComputeThread(f"stage{stage.index}-compute")
        self.queue_length = 0
        self.param_version = 0  # optimizer steps taken
        self.epoch = 0  # global batches finished; ahead of param_version by a pending delayed step or stepless epochs
        # where our parameters come from: every peer that starts from the shared seed holds the same ones; a step
        # alone starts a history of our own (`branch`), and a downloaded state brings its donor's
        self.lineage = INITIAL_LINEAGE
        self.samples_processed = 0
        self.samples_accumulated = 0  # towards the current epoch
        self.samples_next = 0  # towards the next one: microbatches admitted into it early (--lookahead-samples)
        self.samples_late = 0  # in the current epoch's gradients but not its count: microbatches of ended epochs
        # the samples behind the gradients this peer took for its epochs' steps, in all and the most at once: summed
        # over a stage's peers and divided by its epoch, what a global batch held (--samples-per-step, exactly)
        self.step_samples = self.largest_step_samples = 0
        # stage 0's admissions (opaque here) of the microbatches behind those three counts: what a peer shows the
        # stage to prove the samples it holds (server/collab/served.py)
        self.served: list = []
        self.served_next: list = []
        self.served_late: list = []
        self._served_taken: list = []  # the last `take_gradients`' admissions (its epoch's round may still run)
        self._taken_epoch: int | None = None  # ... and the epoch they were taken for
        self._recent: deque[list] = deque(maxlen=RECENT_EPOCHS)  # the last epochs' admissions (`recent_admissions`)
        self._next_grads: list[torch.Tensor | None] = [None] * len(self.params)
        # the parameters of the last few versions (--stash-versions), so that a backward whose forward ran before a
        # step recomputes that forward at the parameters that produced its outputs: a gradient of one model
        self._stash: dict[int, list[torch.Tensor]] = {}
        self.backwards_at_stashed_version = 0  # microbatches whose forward ran before a step, recomputed as it ran
        self.backwards_past_stash = 0  # ... whose version was no longer kept: recomputed at the current parameters
        self.microbatches_processed = 0
        self._seconds_per_sample: dict[str, float] = {}  # EMA per kind of work: "forward", "backward"
        self._fastest: dict[tuple[str, int], float] = {}  # (kind, samples) -> least seconds seen, for --slowdown

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
        with self._timed("forward", n):
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
        with self._timed("backward", n), self._parameters(stashed), self._next_epoch_gradients(early):
            result = stage_backward(
                self.stage,
                inputs,
                grad_outputs=grad_outputs,
                labels=labels,
                grad_weight=n,
                accept=functools.partial(self._accept, caller=caller),
            )
        self.samples_processed += n
        if early:
            self.samples_next += n
        elif late:
            self.samples_late += n
        else:
            self.samples_accumulated += n
        if admission is not None:
            (self.served_next if early else self.served_late if late else self.served).append(admission)
        self.microbatches_processed += 1
        return result

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
    def _next_epoch_gradients(self, active: bool) -> Iterator[None]:
        """Compute thread. While active, `.grad` is the next epoch's accumulation."""
        if not active:
            yield
            return
        current = [p.grad for p in self.params]
        for p, g in zip(self.params, self._next_grads, strict=True):
            p.grad = g
        try:
            yield
        finally:
            self._next_grads = [p.grad for p in self.params]
            for p, g in zip(self.params, current, strict=True):
                p.grad = g

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

    @torch.no_grad()
    def take_gradients(self, end_epoch: bool = False) -> tuple[list[torch.Tensor], int]:
        """Compute thread only. -> (mean gradient per parameter, samples behind it); the next backward starts afresh.
        `end_epoch`: the next backward counts towards the next epoch (delayed steps: the step comes later)."""
        n = self.samples_accumulated + self.samples_late
        self.step_samples += n
        self.largest_step_samples = max(self.largest_step_samples, n)
        grads = [p.grad.div_(n) if (p.grad is not None and n > 0) else torch.zeros_like(p) for p in self.params]
        for p, early in zip(self.params, self._next_grads, strict=True):
            p.grad = early
        self._next_grads = [None] * len(self.params)
        self.samples_accumulated, self.samples_next, self.samples_late = self.samples_next, 0, 0
        self._served_taken, self._taken_epoch = self.served + self.served_late, self.epoch
        self._recent.append(self._served_taken)
        self.served, self.served_next, self.served_late = self.served_next, [], []
        if end_epoch:
            with self.changing_state():
                self.epoch += 1
        return grads, n

    def taken_before(self, epoch: int) -> tuple[int | None, list]:
        """Any thread: (the epoch before `epoch` whose gradients were taken for a round that has not ended in a step
        yet, the admissions behind them), or (None, []): a delayed peer's round, while it reports the next epoch."""
        taken, taken_epoch = self._served_taken, self._taken_epoch
        return (taken_epoch, list(taken)) if taken_epoch is not None and taken_epoch < epoch else (None, [])

    def recent_admissions(self) -> list:
        """Any thread: the admissions of the microbatches accumulated here in the last RECENT_EPOCHS epochs and
        towards the current and next ones (rules.py `frontier` weighs stage 0's signers by them)."""
        return [a for taken in list(self._recent) for a in taken] + [*self.served, *self.served_late, *self.served_next]

    def served_for(self, epoch: int) -> list:
        """Any thread: the admissions behind our weight in `epoch`'s round: those taken with its gradients (a
        synchronous peer's round runs before its epoch moves on), or those accumulating towards it."""
        taken, taken_epoch = self._served_taken, self._taken_epoch
        if taken_epoch == epoch:
            return list(taken)
        return [*self.served, *self.served_late] if self.epoch == epoch else []

    def skip_to(self, epoch: int) -> None:
        """Compute thread only. Move on to `epoch` without a step (the epochs in between had no samples here); the
        gradients accumulated towards the current epoch carry over."""
        with self.changing_state():
            if epoch > self.epoch:
                for p, early in zip(self.params, self._next_grads, strict=True):
                    if early is not None:
                        p.grad = early if p.grad is None else p.grad.add_(early)
                self._next_grads = [None] * len(self.params)
                self.samples_accumulated, self.samples_next = self.samples_accumulated + self.samples_next, 0
                self.served, self.served_next = self.served + self.served_next, []
                self.epoch = epoch

    def drop_gradients(self) -> None:
        """Compute thread only. Forget every accumulated gradient, this epoch's and the next's."""
        for p in self.params:
            p.grad = None
        self._next_grads = [None] * len(self.params)
        self.samples_accumulated = self.samples_next = self.samples_late = 0
        self.served, self.served_next, self.served_late, self._served_taken = [], [], [], []
        self._taken_epoch = None

    @torch.no_grad()
    def return_gradients(self, grads: list[torch.Tensor], n: int) -> None:
        """Compute thread only. Undo `take_gradients`: the epoch goes on accumulating. Gradients of the next epoch
        that were moved in since stay in it (the epoch stays open for them too)."""
        for p, g in zip(self.params, grads, strict=True):
            if n > 0:
                p.grad = g.mul_(n) if p.grad is None else p.grad.add_(g, alpha=n)
        self.samples_accumulated += n
        self.served, self._served_taken, self._taken_epoch = self._served_taken + self.served, [], None

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
            self._served_taken, self._taken_epoch = [], None  # that epoch's round is over

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
        """Under the state lock: `state_tensors`' metadata, and its tensors as they live (not copied)."""
        opt_state = self.optimizer.state_dict()
        tensors = [p.detach() for p in self.params]
        slots = []  # (param index, key) of every tensor in the optimizer state, in a fixed order
        scalars = {}
        for idx in sorted(opt_state["state"]):
            for key in sorted(opt_state["state"][idx]):
                value = opt_state["state"][idx][key]
                if isinstance(value, torch.Tensor):
                    slots.append([idx, key])
                    tensors.append(value.detach())
                else:
                    scalars[f"{idx}/{key}"] = value
        meta = {
            "param_version": self.param_version,
            "epoch": self.epoch,
            "n_params": len(self.params),
            "slots": slots,
            "scalars": scalars,
            "param_groups": opt_state["param_groups"],
            "schedule": self.schedule.state_dict(),
            "lineage": self.lineage,
        }
        return meta, tensors

    def load_state(self, meta: dict, tensors: list[torch.Tensor], with_state: Callable[[], None] | None = None) -> None:
        """Compute thread (or before serving). Inverse of `state_tensors`; raises ValueError on a mismatch, changing
        nothing. `with_state`: loads what is shared with the state (the downloaded state's low-rank factors) in the
        same change, once the state is checked and loaded, so that no reader sees the new parameters with the old
        factors (nor the new factors beside our parameters if the state is refused)."""
        params, state, schedule = self._parsed(meta, tensors)
        with self.changing_state(), torch.no_grad():
            self._stash.clear()  # versions of another history: a backward that names one is recomputed as of now
            for p, t in zip(self.params, params, strict=True):
                p.copy_(t)
            self.optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
            self.schedule.load_state_dict(schedule)
            self.param_version = int(meta["param_version"])
            self.epoch = int(meta.get("epoch", self.param_version))
            lineage = meta.get("lineage")  # a state without one (an older checkpoint) has a history of its own
            self.lineage = lineage if valid_lineage(lineage) else secrets.token_hex(8)
            if with_state is not None:
                with_state()

    def _parsed(self, meta: dict, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[int, dict], dict]:
        """A downloaded state (`state_tensors`' form) as (parameters, optimizer state by parameter index, the schedule
        state to load); raises ValueError unless it fits this stage, holds our optimizer settings and is finite: each
        parameter's optimizer state of its shape, a step count of one number, the schedule ours at some position."""
        n = meta["n_params"]
        if n != len(self.params) or any(t.shape != p.shape for t, p in zip(tensors[:n], self.params, strict=False)):
            raise ValueError("downloaded state does not match this stage's parameters (different model flags?)")
        if len(tensors) != n + len(meta["slots"]):  # a stream that ended early (seen through a relay) is cut short
            raise ValueError(f"the state is incomplete: {len(tensors)} tensors where its metadata lists "
                             f"{n + len(meta['slots'])}")  # fmt: skip
        self._check_optimizer_settings(meta["param_groups"])
        if not all_finite(tensors):
            raise ValueError("downloaded state has non-finite values")
        state: dict = {}
        for (idx, key), t in zip(meta["slots"], tensors[n:], strict=False):
            state.setdefault(int(idx), {})[key] = t
        for name, value in meta["scalars"].items():
            idx, key = name.split("/", 1)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"state's optimizer scalar {name} is {value!r}, not a finite number")
            state.setdefault(int(idx), {})[key] = value
        for idx, slots in state.items():  # loaded as sent, a misfit would break our next step, every step after
            if not 0 <= idx < n:
                raise ValueError(f"state has optimizer state for parameter {idx} of {n}")
            for key, value in slots.items():
                want = () if key == "step" else tuple(self.params[idx].shape)
                if isinstance(value, torch.Tensor) and tuple(value.shape) != want:
                    raise ValueError(f"state's {key} of parameter {idx} has shape {tuple(value.shape)}, not {want}")
        return tensors[:n], state, self._schedule_at(meta["schedule"])

    def _schedule_at(self, theirs: object) -> dict:
        """Our schedule's state at the position a downloaded state's schedule gives (its step counts and last
        learning rates, checked); raises ValueError for one we could not be at. Nothing else of it is loaded: as
        sent, a base rate of 1e6 set our next learning rates, a position of -10^6 a negative one (gradient ascent),
        and a key of its own broke our next step."""
        mine = self.schedule.state_dict()
        if not isinstance(theirs, dict):
            raise ValueError(f"state's schedule is {type(theirs).__name__}, not a dict")
        position = {key: theirs.get(key) for key in ("last_epoch", "_step_count")}
        for key, value in position.items():
            if type(value) is not int or value < 0:
                raise ValueError(f"state's schedule has {key} {value!r}, not a count")
        last, peak = theirs.get("_last_lr"), max(g.get("initial_lr", g["lr"]) for g in self.optimizer.param_groups)
        if (
            not isinstance(last, list)
            or len(last) != len(mine["_last_lr"])
            or not all(isinstance(x, int | float) and not isinstance(x, bool) and 0 <= x <= peak for x in last)
        ):
            wanted = f"{len(mine['_last_lr'])} within [0, {peak}]"
            raise ValueError(f"state's schedule has last learning rates {str(last)[:80]}, not {wanted}")
        return {**mine, **position, "_last_lr": list(last)}

    def not_one_step_from_ours(self, meta: dict, tensors: list[torch.Tensor]) -> str | None:
        """Compute thread. Why a downloaded state (`state_tensors`' form) is not our state after one optimizer step on
        a gradient an honest peer could have stepped on, or None if it is. After a failed round the peer that steps
        alone and the peers that copy it held one state: the copy then takes the stepper's word for a gradient, not
        for a whole state. The gradient its first moments imply is replayed with our optimizer (`replay_step`) and
        must be no larger than any step's: within --clip-grad-norm (the tied weight apart) and the gradient guard's
        limit. The tied weight is not replayed (its round replaces its state before the step: `tied_not_within`),
        nor the version (the caller's). Raises ValueError as `load_state` does for a state that does not fit, others for a malformed one."""
        skip = () if self.tied_index is None else (self.tied_index,)
        why, grads = self._beside_ours(
            meta, tensors, functools.partial(replay_step, self.optim_cfg.optimizer, skip=skip)
        )
        if why is not None:
            return why
        rest = [g for i, g in enumerate(grads) if i != self.tied_index]
        norm, clip, limit = total_norm(rest), self.optim_cfg.clip_grad_norm, self.guard.limit()
        if clip > 0 and norm > clip * (1 + 1e-3):
            return f"it stepped on a gradient of norm {norm:.3g}, above --clip-grad-norm {clip:g}"
        if norm > limit:
            return f"it stepped on a gradient of norm {norm:.3g}, above the gradient guard's limit {limit:.3g}"
        return None

    def not_within_steps_of_ours(self, meta: dict, tensors: list[torch.Tensor], steps: int) -> str | None:
        """Compute thread. Why a downloaded state (`state_tensors`' form) `steps` versions past ours (0, or 2 and
        more: too far to replay, as `not_one_step_from_ours` does one step) cannot be ours after that many steps on
        gradients a step may hold (`server/optim.py` `not_within_steps`), or None if it can. The tied weight is
        checked apart (`tied_not_within`). Raises as `not_one_step_from_ours` does."""
        clip, name = self.optim_cfg.clip_grad_norm, self.optim_cfg.optimizer
        check = functools.partial(
            not_within_steps,
            name,
            steps=steps,
            max_grad_norm=clip if clip > 0 else self.guard.limit(),
            skip=() if self.tied_index is None else (self.tied_index,),
        )
        return self._beside_ours(meta, tensors, check)

    def tied_not_within(self, meta: dict, tensors: list[torch.Tensor], steps: int | None) -> str | None:
        """Compute thread. Why the tied weight of a downloaded state (`state_tensors`' form) cannot be our copy of it
        moved by `steps` steps (None: any number), whatever their histories (`server/optim.py` `not_within_drift`),
        or None; None too for a stage without one. Raises as `not_one_step_from_ours` does."""
        i = self.tied_index
        if i is None:
            return None

        def check(mine, _, groups, theirs, their_state) -> str | None:
            return not_within_drift(self.optim_cfg.optimizer, mine[i], groups, theirs[i], their_state.get(i, {}), steps)

        why = self._beside_ours(meta, tensors, check)
        return None if why is None else f"its tied weight: {why}"

    def _beside_ours(self, meta: dict, tensors: list[torch.Tensor], check: Callable[..., R]) -> R:
        """Compute thread. `check`(our parameters, our optimizer state, our param groups, the state's parameters, its
        optimizer state), all on the CPU, under the state lock: how server/optim.py's checks see a downloaded state
        (`state_tensors`' form) beside ours. Raises ValueError as `load_state` does for a state that does not fit."""
        params, state, _ = self._parsed(meta, tensors)
        with self.state_lock:
            opt = self.optimizer.state_dict()
            mine = [p.detach().cpu() for p in self.params]
            return check(mine, _on_cpu(opt["state"]), opt["param_groups"], [t.cpu() for t in params], _on_cpu(state))

    def branch(self) -> None:
        """Compute thread: we stepped alone; from now on our parameters have a history no peer shares."""
        self.lineage = secrets.token_hex(8)

    def _check_optimizer_settings(self, groups: list[dict]) -> None:
        """Raises ValueError unless a state's optimizer settings are this peer's: the same hyperparameters, and a
        learning rate the schedule can produce (finite, between 0 and the peak)."""
        mine = self.optimizer.param_groups
        if not isinstance(groups, list) or len(groups) != len(mine):
            raise ValueError(
                f"state has {len(groups) if isinstance(groups, list) else '?'} parameter groups, not {len(mine)}"
            )
        indices = [group["params"] for group in self.optimizer.state_dict()["param_groups"]]
        for theirs, own, ours in zip(groups, mine, indices, strict=True):
            if not isinstance(theirs, dict):
                raise ValueError(f"state's parameter group is {type(theirs).__name__}, not a dict")
            if theirs.get("params") != ours:  # torch hangs each parameter's state on the one these name
                raise ValueError(
                    f"state's parameter group lists {str(theirs.get('params'))[:80]}, not {str(ours)[:80]}"
                )
            differ = sorted(k for k in own if k not in ("params", "lr") and _plain(theirs.get(k)) != _plain(own[k]))
            if differ:
                raise ValueError(
                    "state's optimizer settings differ from this peer's: "
                    + ", ".join(f"{k} {theirs.get(k)!r} (here {own[k]!r})" for k in differ[:4])
                )
            lr, peak = theirs.get("lr"), own.get("initial_lr", own["lr"])
            if not isinstance(lr, int | float) or not 0 <= lr <= peak:
                raise ValueError(f"state's learning rate {lr!r} is outside [0, {peak}]")

    @contextlib.contextmanager
    def _timed(self, kind: str, n_samples: int) -> Iterator[None]:
        """Compute thread only. Times one forward or backward of `n_samples` samples into the EMA behind `throughput`.

        `--slowdown` s > 1 emulates a device s times slower than this one running alone: the work is made to last
        s x the least time this worker has taken for the same (kind, n_samples) so far, by sleeping the difference
        between that and the actual elapsed time (never negative). CPU contention only lengthens elapsed times, so the
        running minimum, and with it the emulated time, does not move with the load of other processes; sleeping,
        not computing, leaves the CPU to them, as a slower device on another machine would. The EMA records the
        emulated time even where contention made the work itself longer: the emulated device's speed does not depend
        on what else runs on this machine (the rebalancer must not chase the 2-core test machine's scheduling noise).
        s = 1 never sleeps.
        """
        start = time.perf_counter()
        yield
        synchronize(self.device)  # kernels run asynchronously: time them, not their launches
        elapsed = time.perf_counter() - start
        if self.compute_cfg.slowdown > 1.0:
            key = (kind, n_samples)
            fastest = self._fastest[key] = min(elapsed, self._fastest.get(key, elapsed))
            emulated = self.compute_cfg.slowdown * fastest
            if emulated > elapsed:
                time.sleep(emulated - elapsed)
            elapsed = emulated
        per_sample = elapsed / max(n_samples, 1)
        old = self._seconds_per_sample.get(kind)
        self._seconds_per_sample[kind] = per_sample if old is None else 0.9 * old + 0.1 * per_sample

    @property
    def throughput(self) -> float:
        """Training samples/s this peer sustains: one forward plus one backward (with recompute) per sample."""
        if self.prior_throughput > 0 and self.microbatches_processed < PRIOR_UNTIL:
            return self.prior_throughput
        # the last stage gets no Forward calls: its backward computes the loss
        kinds = ("backward",) if self.stage.is_last else ("forward", "backward")
        if any(k not in self._seconds_per_sample for k in kinds):
            return 0.0
        return 1.0 / sum(self._seconds_per_sample[k] for k in kinds)

    def calibrate(self, batch_size: int, tries: int = 5) -> None:
        """Compute thread, before serving: time the work of a random microbatch, so that the announced throughput
        means something before the first request (the rebalancer and `--stage auto` read it). Keeps the fastest of
        `tries` per kind of work: the first pays for warm-up, and on a shared machine a peer that starts next to
        others is slowed by them at random. Leaves no gradient and counts no sample."""
        cfg, index = self.stage.cfg, self.stage.index
        shape = (batch_size, cfg.max_seq_len)
        fastest: dict[str, float] = {}
        for _ in range(tries):
            self._seconds_per_sample.clear()
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
            for kind, seconds in self._seconds_per_sample.items():
                fastest[kind] = min(seconds, fastest.get(kind, seconds))
        self._seconds_per_sample = fastest
        self.samples_processed = self.samples_accumulated = self.microbatches_processed = 0
        self.served = []
        self.guard.reset()  # random inputs: their gradients say nothing about real ones

    def shutdown(self) -> None:
        self.compute.shutdown()
