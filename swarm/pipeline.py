"""The stage math a server runs, as pure functions: no network, no queues. Tested against `GPT` in one process.

Backward is stateless: it recomputes the forward from the re-sent inputs, so any peer of a stage can serve it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from swarm.model import Stage


@dataclass
class BackwardResult:
    grad_inputs: torch.Tensor | None  # None for stage 0 (its inputs are token ids)
    loss: float | None  # last stage only


@torch.no_grad()
def stage_forward(stage: Stage, inputs: torch.Tensor) -> torch.Tensor:
    return stage(inputs)


def stage_backward(
    stage: Stage,
    inputs: torch.Tensor,
    grad_outputs: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    grad_weight: float = 1.0,
    accept: Callable[[list[torch.Tensor | None], torch.Tensor | None], object] | None = None,
) -> BackwardResult:
    """Recompute the forward, then add `grad_weight` x (gradient of this microbatch) to every parameter's `.grad`.

    The last stage takes `labels` and differentiates its mean loss; the others take `grad_outputs`. A server passes the
    microbatch's sample count as `grad_weight` and divides by the total before stepping, so that microbatches of
    different sizes weigh as their samples. `accept` sees this microbatch's parameter gradients and its
    grad_inputs before anything is added; if it raises, nothing is.
    """
    if (labels is None) == (grad_outputs is None):
        raise ValueError("pass exactly one of grad_outputs (inner stage) or labels (last stage)")
    with torch.enable_grad():
        x = inputs.detach().requires_grad_(inputs.is_floating_point())
        if labels is not None:
            out, out_grad = stage.loss(x, labels), None
        else:
            out, out_grad = stage(x), grad_outputs
        params = [p for p in stage.parameters() if p.requires_grad]
        wrt = params + ([x] if x.requires_grad else [])
        grads = torch.autograd.grad(out, wrt, grad_outputs=out_grad, allow_unused=True)
    grad_inputs = grads[len(params)] if x.requires_grad else None
    if accept is not None:
        accept(list(grads[: len(params)]), grad_inputs)
    with torch.no_grad():
        for p, g in zip(params, grads, strict=False):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g.mul_(grad_weight) if grad_weight != 1.0 else g
            else:
                p.grad.add_(g, alpha=grad_weight)
    return BackwardResult(grad_inputs=grad_inputs, loss=out.item() if labels is not None else None)
