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


MOMENTS = ("exp_avg", "exp_avg_sq")  # a parameter's moments in the optimizer state (AdamW's and our LAMB's names)
REPLAY_RTOL = 1e-3  # of a replayed step: how far from a claimed state rounding may leave it (relative, per tensor)
REPLAY_ULPS = 8  # ... plus this many units in the last place of the values themselves


def _close(replayed: torch.Tensor, claimed: torch.Tensor, scale: float) -> bool:
    """Whether `claimed` is `replayed` up to rounding: within REPLAY_RTOL of `scale` (the size of the change), plus
    REPLAY_ULPS units in the last place of the largest value (a change far below a value's precision, e.g. a small
    step on a large weight, rounds differently in a GPU's fused kernels than in ours)."""
    if claimed.shape != replayed.shape:
        return False
    if not claimed.numel():
        return True
    gap = float((replayed.double() - claimed.double()).abs().max())
    ulps = REPLAY_ULPS * torch.finfo(replayed.dtype).eps * float(replayed.abs().max())
    return gap <= REPLAY_RTOL * scale + ulps + 1e-12


def _same_state(a: dict, b: dict) -> bool:
    """Whether two parameters' optimizer states hold the same keys and values."""
    if set(a) != set(b):
        return False
    for key in a:
        x, y = torch.as_tensor(a[key]), torch.as_tensor(b[key])
        if x.shape != y.shape or not torch.equal(x.double(), y.double()):
            return False
    return True


def replay_step(
    name: str,
    before: Sequence[torch.Tensor],
    before_state: dict[int, dict],
    groups: list[dict],
    after: Sequence[torch.Tensor],
    after_state: dict[int, dict],
    skip: Iterable[int] = (),
) -> tuple[str | None, list[torch.Tensor | None]]:
    """Pure. Whether `after` (parameters, and optimizer state by parameter index) is one step of optimizer `name`
    (with `groups`' hyperparameters and learning rate) from `before` on some gradient, and that gradient.

    Both optimizers keep m' = beta1 m + (1 - beta1) g, so the first moment a step left behind names the gradient it
    stepped on: g = (m' - beta1 m) / (1 - beta1). That gradient, stepped here by an optimizer of our own on copies of
    `before`, must give `after`'s parameters and moments within rounding (REPLAY_RTOL of each tensor's change), and
    the step count must be one more. A parameter whose step count did not move did not step: it and its state must
    not have changed. Returns (why not, None if it is one step; the implied gradients, None for parameters that
    did not step). Parameters in `skip` (a tied weight, whose state its own round replaces before the step) are
    neither checked nor stepped. Inputs are not changed; a malformed state may raise."""
    skipped = set(skip)
    copies = [p.detach().clone() for p in before]
    optimizer = build_optimizer(name, copies, lr=float(groups[0]["lr"]), weight_decay=0.0)
    own = {
        i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()} for i, s in before_state.items()
    }
    optimizer.load_state_dict({"state": own, "param_groups": groups})
    beta1 = float(optimizer.param_groups[0]["betas"][0])
    grads: list[torch.Tensor | None] = [None] * len(copies)
    for i, p in enumerate(copies):
        if i in skipped:
            continue
        claimed, held = after_state.get(i, {}), own.get(i, {})
        if float(claimed.get("step", 0)) == float(held.get("step", 0)):  # this parameter did not step
            if not torch.equal(after[i], before[i]) or not _same_state(claimed, held):
                return f"parameter {i} or its optimizer state changed without a step", grads
            continue
        first = claimed.get(MOMENTS[0])
        if not isinstance(first, torch.Tensor) or first.shape != p.shape:
            return f"parameter {i} stepped without a first moment of its shape", grads
        m = held.get(MOMENTS[0])
        m = torch.zeros_like(p) if m is None else m.to(p.dtype)
        grads[i] = p.grad = (first.to(p.dtype) - beta1 * m) / (1 - beta1)
    if all(g is None for g in grads):
        return "no parameter stepped", grads
    with torch.no_grad():
        optimizer.step()
    for i, p in enumerate(copies):
        if grads[i] is None:
            continue
        mine, claimed = optimizer.state[p], after_state[i]
        if float(claimed.get("step", -1)) != float(mine["step"]):
            return (
                f"parameter {i} claims step {claimed.get('step')} where one step gives {float(mine['step']):g}",
                grads,
            )
        for key in MOMENTS:
            if key not in claimed or not _close(mine[key], claimed[key], float(mine[key].abs().max())):
                return f"parameter {i}'s {key} is not what one step on its implied gradient gives", grads
        if not _close(p, after[i], float((p - before[i]).abs().max())):
            return f"parameter {i} is not where one step on its implied gradient takes it", grads
    return None, grads
