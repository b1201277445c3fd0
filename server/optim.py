"""The stage's local optimizer and learning-rate schedule. All peers of a stage build the same one; they keep it
identical by stepping on identical averaged gradients (server/collab/)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al., 2020): Adam's update rescaled per tensor by ||w|| / ||update||. torch has no LAMB of its own."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        clamp_trust: float = 10.0,
    ):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, clamp_trust=clamp_trust))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                t = state["step"].item()
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat = state["exp_avg"] / (1 - beta1**t)
                v_hat = state["exp_avg_sq"] / (1 - beta2**t)
                update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = p.norm(), update.norm()
                trust = (w_norm / u_norm).clamp(max=group["clamp_trust"]) if w_norm > 0 and u_norm > 0 else 1.0
                p.add_(update, alpha=-group["lr"] * float(trust))


def build_optimizer(name: str, params: Sequence[torch.Tensor], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "lamb":
        return Lamb(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown --optimizer {name!r}; choose adamw or lamb")


def build_schedule(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then cosine decay to 10% over `total_steps` (0: constant after warm-up)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if total_steps <= 0:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
