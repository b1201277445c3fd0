"""The gradients a stage peer accumulates towards its epochs, their sample counts, and the admissions behind them.

A microbatch's gradients go to one of three places by the global batch stage 0 admitted it into (its epoch e, ours E):
- e == E: the epoch's gradients (`.grad` of the parameters), counted in `samples`;
- e > E (admitted early, --lookahead-samples): the next epoch's gradients, held aside, counted in `samples_next`;
- e < E (late: its epoch ended without it): the epoch's gradients, counted in `samples_late` but not towards the
  epoch's end (the stage's counts of that epoch are over).

Each count keeps the admissions of its microbatches (opaque here: stage 0's signed admissions), which a peer shows its
stage to prove the samples it holds (server/collab/served.py). Owner: the compute thread writes everything here;
other threads read the counts and copies of the lists (`served_for`, `taken_before`, `recent_admissions`).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch

RECENT_EPOCHS = 8  # epochs whose admissions `recent_admissions` keeps


class Accumulation:
    def __init__(self, params: Sequence[torch.Tensor]):
        self.params = list(params)
        self.samples = 0  # towards the current epoch
        self.samples_next = 0  # towards the next one: microbatches admitted into it early
        self.samples_late = 0  # in the current epoch's gradients but not its count: microbatches of ended epochs
        # the samples behind the gradients taken for the epochs' steps, in all and the most at once: summed over a
        # stage's peers and divided by its epoch, what a global batch held (--samples-per-step, exactly)
        self.step_samples = self.largest_step_samples = 0
        self.served: list = []
        self.served_next: list = []
        self.served_late: list = []
        self._taken: list = []  # the last `take`'s admissions (its epoch's round may still run)
        self._taken_epoch: int | None = None  # ... and the epoch they were taken for
        self._recent: deque[list] = deque(maxlen=RECENT_EPOCHS)  # the last epochs' admissions
        self._next_grads: list[torch.Tensor | None] = [None] * len(self.params)

    def add(self, n: int, early: bool, late: bool, admission: object | None) -> None:
        """A microbatch of `n` samples whose gradients were just added (to the next epoch's if `early`)."""
        if early:
            self.samples_next += n
        elif late:
            self.samples_late += n
        else:
            self.samples += n
        if admission is not None:
            (self.served_next if early else self.served_late if late else self.served).append(admission)

    @contextlib.contextmanager
    def into_next(self, active: bool) -> Iterator[None]:
        """While active, `.grad` is the next epoch's accumulation."""
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

    @torch.no_grad()
    def take(self, epoch: int, mean: bool = True) -> tuple[list[torch.Tensor], int]:
        """-> (mean gradient per parameter, samples behind it) of `epoch`, ours; the next epoch's become the current.
        `mean=False` (local steps: inner steps took the gradients): the counts and admissions alone, no gradients."""
        n = self.samples + self.samples_late
        self.step_samples += n
        self.largest_step_samples = max(self.largest_step_samples, n)
        grads = []
        if mean:
            grads = [p.grad.div_(n) if (p.grad is not None and n > 0) else torch.zeros_like(p) for p in self.params]
        for p, early in zip(self.params, self._next_grads, strict=True):
            p.grad = early
        self._next_grads = [None] * len(self.params)
        self.samples, self.samples_next, self.samples_late = self.samples_next, 0, 0
        self._taken, self._taken_epoch = self.served + self.served_late, epoch
        self._recent.append(self._taken)
        self.served, self.served_next, self.served_late = self.served_next, [], []
        return grads, n

    def stepped(self) -> None:
        """The round of the epoch taken last ended in a step."""
        self._taken, self._taken_epoch = [], None

    def taken_before(self, epoch: int) -> tuple[int | None, list]:
        """Any thread: (the epoch before `epoch` whose gradients were taken for a round that has not ended in a step
        yet, the admissions behind them), or (None, []): a delayed peer's round, while it reports the next epoch."""
        taken, taken_epoch = self._taken, self._taken_epoch
        return (taken_epoch, list(taken)) if taken_epoch is not None and taken_epoch < epoch else (None, [])

    def recent_admissions(self) -> list:
        """Any thread: the admissions of the microbatches accumulated here in the last RECENT_EPOCHS epochs and
        towards the current and next ones (rules.py `frontier` weighs stage 0's signers by them)."""
        return [a for taken in list(self._recent) for a in taken] + [*self.served, *self.served_late, *self.served_next]

    def served_for(self, epoch: int, current: Callable[[], int]) -> list:
        """Any thread: the admissions behind our weight in `epoch`'s round, `current()` being our epoch: those taken
        with its gradients (a synchronous peer's round runs before its epoch moves on), or those accumulating towards
        it. Our epoch is read after what was taken: a step in between shows as the epoch moved on."""
        taken, taken_epoch = self._taken, self._taken_epoch
        if taken_epoch == epoch:
            return list(taken)
        return [*self.served, *self.served_late] if current() == epoch else []

    def fold_next(self) -> None:
        """The next epoch's gradients join the current one's (epochs without a step in between)."""
        for p, early in zip(self.params, self._next_grads, strict=True):
            if early is not None:
                p.grad = early if p.grad is None else p.grad.add_(early)
        self._next_grads = [None] * len(self.params)
        self.samples, self.samples_next = self.samples + self.samples_next, 0
        self.served, self.served_next = self.served + self.served_next, []

    def drop(self) -> None:
        """Forget every accumulated gradient, this epoch's and the next's."""
        for p in self.params:
            p.grad = None
        self._next_grads = [None] * len(self.params)
        self.samples = self.samples_next = self.samples_late = 0
        self.served, self.served_next, self.served_late, self._taken = [], [], [], []
        self._taken_epoch = None

    @torch.no_grad()
    def give_back(self, grads: list[torch.Tensor], n: int) -> None:
        """Undo `take`: the epoch goes on accumulating. Gradients of the next epoch that were moved in since stay in
        it (the epoch stays open for them too)."""
        for p, g in zip(self.params, grads, strict=True):
            if n > 0:
                p.grad = g.mul_(n) if p.grad is None else p.grad.add_(g, alpha=n)
        self.samples += n
        self.served, self._taken, self._taken_epoch = self._taken + self.served, [], None
