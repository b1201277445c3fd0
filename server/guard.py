"""What keeps a stage's parameters healthy whatever its callers send: gradients no healthy microbatch has are refused
before they are accumulated, and a step that would leave the parameters non-finite does not happen.

Every tensor that crosses the network is already bounded in magnitude (StageSchema, the trainer's reply checks), but a
bounded input can still yield gradients thousands of times larger than usual; the checks here are on the gradients
themselves. They are defence in depth, not robust aggregation: a caller that stays within `factor` x the usual norm
is accepted.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence

import torch

from swarm.protocol.tensors import WireError


class GradientRejected(WireError):
    """A microbatch's gradients were refused: nothing was accumulated. The caller gets INVALID_ARGUMENT."""


def total_norm(tensors: Sequence[torch.Tensor | None]) -> float:
    """The L2 norm of all `tensors` together, in float32 on their device; inf or NaN if any value is non-finite (or
    the squares overflow, which the optimizer's second moments would too)."""
    norms = [torch.linalg.vector_norm(t.detach().float()) for t in tensors if t is not None]
    if not norms:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms])))


class GradientGuard:
    """Refuses a microbatch whose parameter-gradient norm is non-finite, or, once `warmup` norms have been seen, above
    `factor` x the median norm of the last `window` microbatches. Every finite norm enters the window, refused ones
    too: honest gradients that grow quickly (early training: up to 55x the running median, measured) cannot lock the
    stage out for good; outliers move the median only if they are most of the traffic. `factor` 0 checks finiteness
    only. The default factor is large on purpose: refusing an honest microbatch loses it (and stalls stage 0's epoch),
    while an accepted large one is bounded by the step's gradient clipping."""

    def __init__(self, factor: float, warmup: int = 16, window: int = 64):
        if factor < 0 or warmup < 1 or window < warmup:
            raise ValueError(f"bad gradient guard: factor {factor}, warmup {warmup}, window {window}")
        self.factor, self.warmup = factor, warmup
        self.norms: deque[float] = deque(maxlen=window)
        self.accepted = self.rejected = 0

    def reset(self) -> None:
        self.norms.clear()
        self.accepted = self.rejected = 0

    def limit(self) -> float:
        """The largest norm accepted now (inf during the warm-up or with factor 0)."""
        if self.factor == 0 or len(self.norms) < self.warmup:
            return math.inf
        return self.factor * statistics.median(self.norms)

    def check(self, grads: Sequence[torch.Tensor | None]) -> float:
        """Raises GradientRejected (and counts it) for gradients to refuse; returns the norm of accepted ones."""
        norm = total_norm(grads)
        if not math.isfinite(norm):
            self.rejected += 1
            raise GradientRejected("gradients of this microbatch are not finite; nothing accumulated")
        limit = self.limit()
        self.norms.append(norm)
        if norm > limit:
            self.rejected += 1
            raise GradientRejected(
                f"gradient norm {norm:.3g} of this microbatch exceeds {limit:.3g} ({self.factor:g} x the median of "
                f"the last {len(self.norms) - 1}); nothing accumulated"
            )
        self.accepted += 1
        return norm


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Any thread. One device synchronisation for the whole list (NaN propagates through amax/amin; inf is one)."""
    if not tensors:
        return True
    ends = [e for t in tensors if t.numel() for e in torch.aminmax(t.detach())]
    return not ends or bool(torch.isfinite(torch.stack([e.float().to(ends[0].device) for e in ends])).all())
