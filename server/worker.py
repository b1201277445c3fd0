"""The stage's compute: one thread owns the module and optimizer; the event loop only submits work to it.

Requests run one at a time in arrival order, so a backward and an optimizer step never interleave. Gradients of each
microbatch are weighted by its sample count; after `samples_per_step` samples the worker divides by the total, clips,
steps and bumps `param_version`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from server.config import ServerConfig
from swarm.model import Stage
from swarm.pipeline import BackwardResult, stage_backward, stage_forward

R = TypeVar("R")


class DeadlineExpired(Exception):
    """The caller's deadline passed while the request waited in the queue: nothing was computed."""


class StageWorker:
    def __init__(self, stage: Stage, cfg: ServerConfig, device: torch.device):
        self.stage, self.cfg, self.device = stage.to(device).train(), cfg, device
        self.optimizer = torch.optim.AdamW(stage.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage{stage.index}-compute")
        self.queue_length = 0
        self.param_version = 0
        self.samples_processed = 0
        self.samples_accumulated = 0
        self._seconds_per_sample: dict[str, float] = {}  # EMA per kind of work: "forward", "backward"

    async def submit(self, fn: Callable[[], R], deadline: float | None = None) -> R:
        """Run `fn` on the compute thread. Raises DeadlineExpired instead of running it if `deadline` (monotonic) passed."""

        def guarded() -> R:
            if deadline is not None and time.monotonic() > deadline:
                raise DeadlineExpired
            return fn()

        self.queue_length += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, guarded)
        finally:
            self.queue_length -= 1

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Compute thread only."""
        with self._timed("forward", inputs.shape[0]):
            return stage_forward(self.stage, inputs)

    def backward(
        self, inputs: torch.Tensor, grad_outputs: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> BackwardResult:
        """Compute thread only. Accumulates this microbatch's gradients and steps when enough samples arrived."""
        n = inputs.shape[0]
        with self._timed("backward", n):
            result = stage_backward(self.stage, inputs, grad_outputs=grad_outputs, labels=labels, grad_weight=n)
        self.samples_processed += n
        self.samples_accumulated += n
        if self.samples_accumulated >= self.cfg.samples_per_step:
            self._step()
        return result

    def _step(self) -> None:
        params = [p for p in self.stage.parameters() if p.grad is not None]
        for p in params:
            p.grad.div_(self.samples_accumulated)
        if self.cfg.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, self.cfg.clip_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.samples_accumulated = 0
        self.param_version += 1

    @contextlib.contextmanager
    def _timed(self, kind: str, n_samples: int) -> Iterator[None]:
        start = time.perf_counter()
        yield
        elapsed = time.perf_counter() - start
        if self.cfg.slowdown > 1.0:  # emulate slower hardware, for tests and benchmarks
            time.sleep(elapsed * (self.cfg.slowdown - 1.0))
            elapsed *= self.cfg.slowdown
        per_sample = elapsed / max(n_samples, 1)
        old = self._seconds_per_sample.get(kind)
        self._seconds_per_sample[kind] = per_sample if old is None else 0.9 * old + 0.1 * per_sample

    @property
    def throughput(self) -> float:
        """Training samples/s this peer sustains: one forward plus one backward (with recompute) per sample."""
        total = sum(self._seconds_per_sample.values())
        return 1.0 / total if total > 0 else 0.0

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
