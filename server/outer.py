"""Local-step training's outer loop (DiLoCo, Douillard et al. 2023): the outer parameters a stage's peers agreed on at
their last outer round, and the outer optimizer that moves them.

Between outer rounds every peer of a stage steps its own (inner) optimizer on its own microbatches. At an outer round
each peer's pseudo-gradient is the outer parameters minus its live ones (what its inner steps moved them by, with the
sign of a gradient); the stage averages these, weighted by the samples behind each, and every peer applies the same
outer step to the same outer parameters, then takes them as its live parameters. Peers that hold the same outer state
and get the same average (hivemind's all-reduce hands every member the same one) stay bitwise equal at every outer
boundary, whatever their inner steps were.

The outer optimizer is torch's SGD with Nesterov momentum (the paper's: learning rate 0.7, momentum 0.9; ours by
default 1 and 0, plain averaging of the peers' parameters, which trained better at our runs' length). Its one
tensor of state per parameter, the momentum, travels with a stage's state (`momentum`, `load`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class OuterState:
    """Owner: the stage's compute thread, under the worker's state lock."""

    def __init__(self, params: Sequence[torch.Tensor], lr: float, momentum: float):
        self.params = [p.detach().clone() for p in params]
        self.optimizer = torch.optim.SGD(self.params, lr=lr, momentum=momentum, nesterov=momentum > 0)
        self.steps = 0  # outer steps taken (shared with the state: a joiner goes on counting)
        self.skipped = 0  # outer rounds whose average was not finite: no outer step

    @torch.no_grad()
    def pseudo_gradients(self, live: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The outer parameters minus `live` (new tensors, on the outer parameters' device)."""
        return [o - p.detach().to(o.device, o.dtype) for o, p in zip(self.params, live, strict=True)]

    @torch.no_grad()
    def step(self, averaged: Sequence[torch.Tensor]) -> bool:
        """One outer step on the stage's averaged pseudo-gradients; False (and no step) if any value is not finite:
        every peer of the round got the same average, so every one of them skips alike."""
        if not all(bool(torch.isfinite(g).all()) for g in averaged):
            self.skipped += 1
            return False
        for p, g in zip(self.params, averaged, strict=True):
            p.grad = g.to(p.device, p.dtype)
        self.optimizer.step()
        for p in self.params:
            p.grad = None
        self.steps += 1
        return True

    def momentum(self) -> list[torch.Tensor]:
        """The outer momentum of every parameter as it lives (zeros before the first outer step: SGD's first step
        with a zero buffer is its first step without one)."""
        out = []
        for p in self.params:
            buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
            out.append(torch.zeros_like(p) if buf is None else buf)
        return out

    @torch.no_grad()
    def load(self, params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], steps: int) -> None:
        """Take a downloaded outer state (checked by the caller: shapes and finiteness)."""
        for p, t in zip(self.params, params, strict=True):
            p.copy_(t)
        for p, m in zip(self.params, momentum, strict=True):
            self.optimizer.state[p] = {"momentum_buffer": m.to(p.device, p.dtype).clone()}
        self.steps = steps
