"""A stage's state as it travels: parameters and optimizer state as (metadata, tensors), its digest, and the checks a
downloaded state passes before it is loaded.

The form (`state_view`): the parameters, then every tensor of the optimizer state in a fixed order (`slots` names
each by parameter index and key), its non-tensor values as `scalars`, the optimizer's param groups, the schedule's
state, the epoch, the step count and the lineage. `parse_state` is its inverse for a state that came over the
network: nothing in it is trusted, and a state that does not fit the stage, holds other optimizer settings, is not
finite or puts the schedule where ours cannot be is refused with ValueError, changing nothing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard, TypeVar

import torch

from server.config import OptimizerConfig
from server.guard import GradientGuard, all_finite, total_norm
from server.optim import not_within_drift, not_within_steps, replay_step

R = TypeVar("R")

INITIAL_LINEAGE = "init"
_LINEAGE = re.compile(r"init|[0-9a-f]{16}")


def valid_lineage(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and _LINEAGE.fullmatch(value) is not None


def _digested(meta: dict) -> dict:
    """What a state's digest covers of its metadata: its epoch, the optimizer's per-tensor layout and scalars, the
    learning rates, and the schedule's position. Not what says who holds the state (its step counter, lineage), nor
    settings whose keys differ between torch versions over the same tensors (peers check those when they load). A
    state of local-step training (`outer` in its metadata): its epoch and outer step count alone, the rest being the
    peer's own inner optimizer."""
    if isinstance(meta.get("outer"), dict):
        return {"epoch": meta.get("epoch"), "n_params": meta.get("n_params"), "outer": meta["outer"]}
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
    `state_view` gives it, or as it arrived with a downloaded state), what `_digested` takes of it. Equal exactly for
    bitwise-equal states. A peer vouches for a state with it (server/collab/recovery.py), so it must not be
    forgeable: a fingerprint of sums could be kept by a state whose values were moved around."""
    h = hashlib.sha256()
    if meta is not None:
        h.update(json.dumps(_digested(meta), sort_keys=True, default=repr).encode())  # tuples and lists alike
        if isinstance(meta.get("outer"), dict) and isinstance(meta.get("n_params"), int):
            n = meta["n_params"]  # local steps: the outer parameters and the outer momentum (`split_outer`)
            tensors = [*tensors[:n], *tensors[len(tensors) - n :]] if len(tensors) >= 2 * n else list(tensors)
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()[:32]


def _plain(value: Any) -> Any:
    """Tuples as lists: a state that travelled through msgpack or JSON has lists where the optimizer has tuples."""
    return list(value) if isinstance(value, tuple) else value


def on_cpu(state: dict[int, dict]) -> dict[int, dict]:
    """An optimizer state by parameter index, its tensors on the CPU (a copy of those that were elsewhere)."""
    return {i: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()} for i, s in state.items()}


def state_view(
    params: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    param_version: int,
    epoch: int,
    lineage: str,
) -> tuple[dict, list[torch.Tensor]]:
    """Under the owner's state lock: the state's metadata, and its tensors as they live (not copied)."""
    opt_state = optimizer.state_dict()
    tensors = [p.detach() for p in params]
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
        "param_version": param_version,
        "epoch": epoch,
        "n_params": len(params),
        "slots": slots,
        "scalars": scalars,
        "param_groups": opt_state["param_groups"],
        "schedule": schedule.state_dict(),
        "lineage": lineage,
    }
    return meta, tensors


def split_outer(
    meta: dict, tensors: list[torch.Tensor], params: Sequence[torch.Tensor], local: bool
) -> tuple[list[torch.Tensor], tuple[list[torch.Tensor], int] | None]:
    """A downloaded state (`state_view`'s form; with local steps, the outer momentum after it and `outer` in the
    metadata) as (what `parse_state` reads, (the outer momentum, the outer step count) or None). `local`: whether we
    train with local steps; a state of the other kind is refused with ValueError, as is an outer part that does not
    fit `params` or is not finite."""
    outer = meta.get("outer")
    if not local:
        if outer is not None:
            raise ValueError("the state is of local-step training (--local-batch); this peer steps synchronously")
        return tensors, None
    if not isinstance(outer, dict):
        raise ValueError("the state is of synchronous training; this peer trains with local steps (--local-batch)")
    steps, n = outer.get("steps"), len(params)
    if type(steps) is not int or steps < 0:
        raise ValueError(f"the state's outer step count is {steps!r}, not a count")
    if len(tensors) < 2 * n:
        raise ValueError(f"the state is incomplete: {len(tensors)} tensors, fewer than twice the {n} parameters")
    momentum = tensors[len(tensors) - n :]
    if any(tuple(m.shape) != tuple(p.shape) for m, p in zip(momentum, params, strict=True)):
        raise ValueError("the state's outer momentum does not match this stage's parameters")
    if not all_finite(momentum):
        raise ValueError("the state's outer momentum has non-finite values")
    return tensors[: len(tensors) - n], (momentum, steps)


def parse_state(
    meta: dict,
    tensors: list[torch.Tensor],
    params: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
) -> tuple[list[torch.Tensor], dict[int, dict], dict]:
    """A downloaded state (`state_view`'s form) as (parameters, optimizer state by parameter index, the schedule
    state to load); raises ValueError unless it fits `params`, holds `optimizer`'s settings and is finite: each
    parameter's optimizer state of its shape, a step count of one number, the schedule ours at some position."""
    n = meta["n_params"]
    if n != len(params) or any(t.shape != p.shape for t, p in zip(tensors[:n], params, strict=False)):
        raise ValueError("downloaded state does not match this stage's parameters (different model flags?)")
    if len(tensors) != n + len(meta["slots"]):  # a stream that ended early is cut short
        listed = n + len(meta["slots"])
        raise ValueError(f"the state is incomplete: {len(tensors)} tensors where its metadata lists {listed}")
    check_optimizer_settings(optimizer, meta["param_groups"])
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
            want = () if key == "step" else tuple(params[idx].shape)
            if isinstance(value, torch.Tensor) and tuple(value.shape) != want:
                raise ValueError(f"state's {key} of parameter {idx} has shape {tuple(value.shape)}, not {want}")
    return tensors[:n], state, schedule_at(schedule, optimizer, meta["schedule"])


def schedule_at(
    schedule: torch.optim.lr_scheduler.LRScheduler, optimizer: torch.optim.Optimizer, theirs: object
) -> dict:
    """Our schedule's state at the position a downloaded state's schedule gives (its step counts and last learning
    rates, checked); raises ValueError for one we could not be at. Nothing else of it is loaded: as sent, a base rate
    of 1e6 would set our next learning rates, a position of -10^6 a negative one (gradient ascent), and a key of its
    own would break our next step."""
    mine = schedule.state_dict()
    if not isinstance(theirs, dict):
        raise ValueError(f"state's schedule is {type(theirs).__name__}, not a dict")
    position = {key: theirs.get(key) for key in ("last_epoch", "_step_count")}
    for key, value in position.items():
        if type(value) is not int or value < 0:
            raise ValueError(f"state's schedule has {key} {value!r}, not a count")
    last, peak = theirs.get("_last_lr"), max(g.get("initial_lr", g["lr"]) for g in optimizer.param_groups)
    if (
        not isinstance(last, list)
        or len(last) != len(mine["_last_lr"])
        or not all(isinstance(x, int | float) and not isinstance(x, bool) and 0 <= x <= peak for x in last)
    ):
        wanted = f"{len(mine['_last_lr'])} within [0, {peak}]"
        raise ValueError(f"state's schedule has last learning rates {str(last)[:80]}, not {wanted}")
    return {**mine, **position, "_last_lr": list(last)}


def check_optimizer_settings(optimizer: torch.optim.Optimizer, groups: list[dict]) -> None:
    """Raises ValueError unless a state's optimizer settings are `optimizer`'s: the same hyperparameters, and a
    learning rate the schedule can produce (finite, between 0 and the peak)."""
    mine = optimizer.param_groups
    if not isinstance(groups, list) or len(groups) != len(mine):
        raise ValueError(
            f"state has {len(groups) if isinstance(groups, list) else '?'} parameter groups, not {len(mine)}"
        )
    indices = [group["params"] for group in optimizer.state_dict()["param_groups"]]
    for theirs, own, ours in zip(groups, mine, indices, strict=True):
        if not isinstance(theirs, dict):
            raise ValueError(f"state's parameter group is {type(theirs).__name__}, not a dict")
        if theirs.get("params") != ours:  # torch hangs each parameter's state on the one these name
            raise ValueError(f"state's parameter group lists {str(theirs.get('params'))[:80]}, not {str(ours)[:80]}")
        differ = sorted(k for k in own if k not in ("params", "lr") and _plain(theirs.get(k)) != _plain(own[k]))
        if differ:
            raise ValueError(
                "state's optimizer settings differ from this peer's: "
                + ", ".join(f"{k} {theirs.get(k)!r} (here {own[k]!r})" for k in differ[:4])
            )
        lr, peak = theirs.get("lr"), own.get("initial_lr", own["lr"])
        if not isinstance(lr, int | float) or not 0 <= lr <= peak:
            raise ValueError(f"state's learning rate {lr!r} is outside [0, {peak}]")


class StateChecks:
    """Whether a downloaded state can be ours after the steps it claims, beside our own state (read under the
    owner's state lock). Built by the stage's worker; server/collab/recovery.py asks before it loads a state."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        schedule: torch.optim.lr_scheduler.LRScheduler,
        state_lock: threading.Lock,
        optim_cfg: OptimizerConfig,
        tied_index: int | None,
        guard: GradientGuard,
    ):
        self.params, self.optimizer, self.schedule, self.state_lock = list(params), optimizer, schedule, state_lock
        self.optim_cfg, self.tied_index, self.guard = optim_cfg, tied_index, guard

    def not_one_step_from_ours(self, meta: dict, tensors: list[torch.Tensor]) -> str | None:
        """Compute thread. Why a downloaded state (`state_view`'s form) is not our state after one optimizer step on
        a gradient an honest peer could have stepped on, or None if it is. After a failed round the peer that steps
        alone and the peers that copy it held one state: the copy then takes the stepper's word for a gradient, not
        for a whole state. The gradient its first moments imply is replayed with our optimizer (`replay_step`) and
        must be no larger than any step's: within --clip-grad-norm (the tied weight apart) and the gradient guard's
        limit. The tied weight is not replayed (its round replaces its state before the step: `tied_not_within`),
        nor the version (the caller's). Raises ValueError as `parse_state` does for a state that does not fit, others
        for a malformed one."""
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
        """Compute thread. Why a downloaded state (`state_view`'s form) `steps` versions past ours (0, or 2 and
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
        """Compute thread. Why the tied weight of a downloaded state (`state_view`'s form) cannot be our copy of it
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
        (`state_view`'s form) beside ours. Raises ValueError as `parse_state` does for a state that does not fit."""
        params, state, _ = parse_state(meta, tensors, self.params, self.optimizer, self.schedule)
        with self.state_lock:
            opt = self.optimizer.state_dict()
            mine = [p.detach().cpu() for p in self.params]
            return check(mine, on_cpu(opt["state"]), opt["param_groups"], [t.cpu() for t in params], on_cpu(state))
