"""The stage's local optimizer and learning-rate schedule. All peers of a stage build the same one; they keep it
identical by stepping on identical averaged gradients (server/collab/)."""

from __future__ import annotations

import functools
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


def _changed_without_step(i: int, old: torch.Tensor, new: torch.Tensor, held: dict, claimed: dict) -> str | None:
    """Why parameter `i`, whose step count did not move, is not as it was (value or optimizer state), or None."""
    if not torch.equal(new, old) or not _same_state(claimed, held):
        return f"parameter {i} or its optimizer state changed without a step"
    return None


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
            if why := _changed_without_step(i, before[i], after[i], held, claimed):
                return why, grads
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


def moment_ratio_bound(beta1: float, beta2: float, step: int) -> float:
    """Pure. The largest |m| / sqrt(v) any `step` gradients leave in Adam's moments (m = (1 - beta1) sum beta1^i
    g_i, v = (1 - beta2) sum beta2^i g_i^2, from zero): Cauchy-Schwarz gives (1 - beta1) / sqrt(1 - beta2) x
    sqrt(sum_{i < step} (beta1^2 / beta2)^i), reached by one gradient sequence. Averaging moments keeps it (Jensen)."""
    r = beta1 * beta1 / beta2
    terms = step if r == 1 else (1 - r**step) / (1 - r)
    return (1 - beta1) / math.sqrt(1 - beta2) * math.sqrt(max(terms, 1.0))


@functools.cache  # the same few (first, last) for every parameter of a state
def update_ratio_bound(beta1: float, beta2: float, first: int, last: int) -> float:
    """Pure. The largest |m_hat| / sqrt(v_hat) (bias-corrected: what AdamW and LAMB step by, before eps) at any
    step count from `first` to `last`: `moment_ratio_bound` x sqrt(1 - beta2^t) / (1 - beta1^t)."""
    return max(
        moment_ratio_bound(beta1, beta2, t) * math.sqrt(1 - beta2**t) / (1 - beta1**t)
        for t in range(max(first, 1), max(last, first, 1) + 1)
    )


BOUND_RTOL = 1e-3  # of a bound on a state some steps on: the slack rounding gets
MAX_BOUNDED_STEPS = 1000  # a state further on than this is refused: its bound would say little (and cost time).
# Copies after a failed round found honest references up to 42 versions on in a 6-minute soak (epochs of ~0.4 s)


def _moments_beyond(m: torch.Tensor, v: torch.Tensor, ratio: float) -> bool:
    """Pure. Whether first moments `m` exceed `ratio` x sqrt(v) anywhere (float64 inputs): no gradients leave that."""
    tiny = torch.finfo(torch.float32).tiny
    # slack for gradients so small that their squares underflow float32 (|g| ~ 1e-20: v denormal or 0 beside m),
    # and a margin of 1e-9 of the largest m: neither lets m move a step beyond ~1e-19 / eps
    room = ratio * (v + 1e-40).sqrt() * (1 + BOUND_RTOL) + 1e-9 * float(m.abs().max()) + tiny
    return bool((m.abs() > room).any())


def _moved_beyond(
    name: str, old: torch.Tensor, new: torch.Tensor, steps: int, lr: float, decay: float, ratio: float
) -> bool:
    """Pure. Whether `new` is further from `old` than `steps` steps of optimizer `name` (peak learning rate `lr`,
    weight decay `decay`) can move a parameter whose |m_hat| / sqrt(v_hat) stays within `ratio`: AdamW moves each
    value by at most lr (ratio + decay |w|) a step, LAMB each tensor by at most lr ||w|| (its trust ratio)."""
    moved, slack = new.double() - old.double(), REPLAY_ULPS * torch.finfo(old.dtype).eps * float(old.abs().max())
    if name == "lamb":
        room = ((1 + lr) ** steps - 1) * (float(old.double().norm()) + math.sqrt(old.numel()) * ratio)
        return float(moved.norm()) > room * (1 + BOUND_RTOL) + slack
    reach = steps * lr * ratio
    room_each = reach + ((1 + lr * decay) ** steps - 1) * (old.double().abs() + reach)
    return bool((moved.abs() > room_each * (1 + BOUND_RTOL) + slack).any())


RATIO_STEPS = 20_000  # past this many steps Adam's bias corrections are 1 within 1e-8: the update bound's limit


def beyond_steps(name: str, groups: list[dict], before: torch.Tensor, after: torch.Tensor, steps: int) -> bool:
    """Pure. Whether `after` is further from `before` (one parameter) than `steps` steps of optimizer `name` can move
    it from there, whatever the gradients (`groups`: our hyperparameters; the peak learning rate). Local-step
    training holds an outer round's average pseudo-gradient to it: every honest peer's inner steps stay within it, and
    so does any average of theirs."""
    beta1, beta2 = (float(b) for b in groups[0]["betas"])
    lr = float(groups[0].get("initial_lr", groups[0]["lr"]))
    decay = float(groups[0].get("weight_decay", 0.0))
    ratio = update_ratio_bound(beta1, beta2, 1, RATIO_STEPS)
    return _moved_beyond(name, before, after, steps, lr, decay, ratio)


def not_within_drift(
    name: str, before: torch.Tensor, groups: list[dict], after: torch.Tensor, after_state: dict, steps: int | None
) -> str | None:
    """Pure. Why `after` (one parameter, and its optimizer state) cannot be `before` moved by at most `steps` steps of
    optimizer `name` (`groups`: our hyperparameters), whatever the history between them, or None. For a copy of a
    parameter whose state may have drifted from ours (the tied weight: its copies step apart after a round that
    failed for some of its peers, until the next average of their states): neither the step counts nor the moments
    can be compared with ours, so only what no history gives is refused: moments whose next steps would be larger
    than any gradients make (|m| above the bound beside sqrt(v), which averaged states keep too), or the parameter
    moved further than `steps` steps of the largest update (None: any distance). A malformed state may raise."""
    if before.shape != after.shape:
        return f"it has shape {tuple(after.shape)}, not {tuple(before.shape)}"
    beta1, beta2 = (float(b) for b in groups[0]["betas"])
    lr = float(groups[0].get("initial_lr", groups[0]["lr"]))
    decay = float(groups[0].get("weight_decay", 0.0))
    t = min(int(float(after_state.get("step", 0))), RATIO_STEPS)
    m, v = after_state.get(MOMENTS[0]), after_state.get(MOMENTS[1])
    if t < 1 and (m is not None or v is not None):  # an honest state drops its moments with its step count
        return "it holds moments without a step count: its next step would take them as one step's"
    if t > 0:
        if (
            not isinstance(m, torch.Tensor)
            or not isinstance(v, torch.Tensor)
            or m.shape != before.shape
            or v.shape != before.shape
        ):
            return "it stepped without both moments of its shape"
        # the bound of any step count, not of the one sent: an average of copies at different counts (rounded down
        # when loaded) may hold moments a little beyond its own count's bound
        if bool((v < 0).any()) or _moments_beyond(
            m.double(), v.double(), moment_ratio_bound(beta1, beta2, RATIO_STEPS)
        ):
            return "its moments are not what any gradients leave"
    ratio = update_ratio_bound(beta1, beta2, 1, RATIO_STEPS)
    if steps is not None and _moved_beyond(name, before, after, steps, lr, decay, ratio):
        return f"it moved further than {steps} steps can take it"
    return None


def not_within_steps(
    name: str,
    before: Sequence[torch.Tensor],
    before_state: dict[int, dict],
    groups: list[dict],
    after: Sequence[torch.Tensor],
    after_state: dict[int, dict],
    steps: int,
    max_grad_norm: float,
    skip: Iterable[int] = (),
) -> str | None:
    """Pure. Why `after` (parameters, optimizer state by parameter index) cannot be `steps` steps of optimizer `name`
    (`groups`: our hyperparameters, with the peak learning rate as "initial_lr" or "lr") from `before` on gradients of
    norm at most `max_grad_norm` (all parameters but `skip` together; inf: any), or None if it can. For a state too
    far on to replay (`replay_step` takes one step): no step is replayed, but no step can leave what is refused here.

    Per parameter, j = its step count's rise, 0 <= j <= `steps` (0: it and its state unchanged). Its moments: v
    decays no faster than beta2^j, and |m| <= `moment_ratio_bound` x sqrt(v) (true of every state gradients made);
    over all parameters, sum(v - beta2^j v0) <= steps (1 - beta2) G^2 and ||m - beta1^j m0|| <= steps (1 - beta1) G.
    Its parameters: AdamW moves each value by at most lr (`update_ratio_bound` + weight_decay |w|) a step; LAMB each
    tensor by at most lr ||w|| a step (its trust ratio), so (1 + lr)^j - 1 of (||w|| + sqrt(n) x the ratio bound).
    So a peer that lies about how far it stepped moves us no further than that many steps of its choosing could, and
    leaves moments our next steps can live with (a huge m over a tiny v would make them huge). A malformed state may
    raise."""
    if not 0 <= steps <= MAX_BOUNDED_STEPS:
        return f"it claims {steps} steps past ours, more than the {MAX_BOUNDED_STEPS} a copy takes on bounds"
    skipped = set(skip)
    beta1, beta2 = (float(b) for b in groups[0]["betas"])
    lr = float(groups[0].get("initial_lr", groups[0]["lr"]))
    decay = float(groups[0].get("weight_decay", 0.0))
    v_rise = m_shift = 0.0
    for i, (old, new) in enumerate(zip(before, after, strict=True)):
        if new.shape != old.shape:
            return f"parameter {i} has shape {tuple(new.shape)}, not {tuple(old.shape)}"
        if i in skipped or not old.numel():
            continue
        claimed, held = after_state.get(i, {}), before_state.get(i, {})
        t0 = int(float(held.get("step", 0)))
        j = int(float(claimed.get("step", 0))) - t0
        if not 0 <= j <= steps or float(claimed.get("step", 0)) != t0 + j:
            return f"parameter {i} claims step {claimed.get('step')} where {steps} steps from {t0} give at most {t0 + steps}"
        if j == 0:
            if why := _changed_without_step(i, old, new, held, claimed):
                return why
            continue
        m, v = claimed.get(MOMENTS[0]), claimed.get(MOMENTS[1])
        if (
            not isinstance(m, torch.Tensor)
            or not isinstance(v, torch.Tensor)
            or m.shape != old.shape
            or v.shape != old.shape
        ):
            return f"parameter {i} stepped without both moments of its shape"
        m, v = m.double(), v.double()
        m0 = held[MOMENTS[0]].double() if MOMENTS[0] in held else torch.zeros_like(m)
        v0 = held[MOMENTS[1]].double() if MOMENTS[1] in held else torch.zeros_like(v)
        tiny = torch.finfo(torch.float32).tiny
        if bool((v < beta2**j * v0 * (1 - BOUND_RTOL) - tiny).any()):
            return f"parameter {i}'s second moments fell faster than {j} steps let them"
        if _moments_beyond(m, v, moment_ratio_bound(beta1, beta2, t0 + j)):
            return f"parameter {i}'s first moments exceed what any gradients give beside its second moments"
        v_rise += float((v - beta2**j * v0).sum())
        m_shift += float((m - beta1**j * m0).square().sum())
        if _moved_beyond(name, old, new, j, lr, decay, update_ratio_bound(beta1, beta2, t0 + 1, t0 + j)):
            return f"parameter {i} moved further than {j} steps can take it"
    if math.isfinite(max_grad_norm):
        if v_rise > steps * (1 - beta2) * max_grad_norm**2 * (1 + BOUND_RTOL):
            return f"its second moments grew more than {steps} steps on gradients of norm {max_grad_norm:.3g} can"
        if math.sqrt(m_shift) > steps * (1 - beta1) * max_grad_norm * (1 + BOUND_RTOL):
            return f"its first moments moved more than {steps} steps on gradients of norm {max_grad_norm:.3g} can"
    return None
