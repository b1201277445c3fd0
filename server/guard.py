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
from collections import OrderedDict, deque
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


MIN_EVIDENCE_NORM = 1e-12  # a norm at most this is no evidence of scale (zero gradients: nothing learned)
FLOOR_NORM = 1e-2  # the median the limit assumes at least: the limit never drops below factor x this
MAX_CALLERS = 256  # callers whose recent norms are kept (the least recent forgotten first)


class GradientGuard:
    """Refuses a microbatch whose parameter-gradient norm is non-finite, or, once `warmup` norms have been seen, above
    `factor` x the scale the stage's callers show. No minority of callers can move that scale:
    - each caller (its authenticated identity where the transport gives one, else its address) keeps a window of its
      own last `window` norms, and the scale is the median of the callers' medians: one vote per caller, however much
      it sends. A caller that sends most of the traffic moves the scale no further than any other caller;
    - a norm of (nearly) zero enters no window: an empty gradient says nothing of the scale of real ones, and a caller
      sending them would otherwise drive the limit to zero and refuse every honest microbatch;
    - the limit never falls below `factor` x FLOOR_NORM, whatever the callers show (a majority of hostile callers
      sending tiny gradients can lower it that far, no further).
    Every finite norm enters its caller's window, refused ones too: honest gradients that grow quickly (early training:
    up to 55x the running median, measured) cannot lock a caller out for good. `factor` 0 checks finiteness only. The
    default factor is large on purpose: refusing an honest microbatch loses it (and stalls stage 0's epoch), while an
    accepted large one is bounded by the step's gradient clipping."""

    def __init__(self, factor: float, warmup: int = 16, window: int = 64, floor: float = FLOOR_NORM):
        if factor < 0 or warmup < 1 or window < 1 or floor < 0:
            raise ValueError(f"bad gradient guard: factor {factor}, warmup {warmup}, window {window}, floor {floor}")
        self.factor, self.warmup, self.window, self.floor = factor, warmup, window, floor
        self.norms: OrderedDict[str, deque[float]] = OrderedDict()  # caller -> its recent norms
        self.accepted = self.rejected = 0

    def reset(self) -> None:
        self.norms.clear()
        self.accepted = self.rejected = 0

    def scale(self) -> float | None:
        """The median of the callers' median norms; None before `warmup` norms in all."""
        if sum(map(len, self.norms.values())) < self.warmup:
            return None
        return statistics.median(statistics.median(w) for w in self.norms.values())

    def limit(self) -> float:
        """The largest norm accepted now (inf during the warm-up or with factor 0)."""
        scale = self.scale()
        if self.factor == 0 or scale is None:
            return math.inf
        return self.factor * max(scale, self.floor)

    def check(self, grads: Sequence[torch.Tensor | None], caller: str = "") -> float:
        """Raises GradientRejected (and counts it) for gradients to refuse; returns the norm of accepted ones."""
        norm = total_norm(grads)
        if not math.isfinite(norm):
            self.rejected += 1
            raise GradientRejected("gradients of this microbatch are not finite; nothing accumulated")
        limit = self.limit()
        if norm > MIN_EVIDENCE_NORM:
            self._record(caller, norm)
        if norm > limit:
            self.rejected += 1
            raise GradientRejected(
                f"gradient norm {norm:.3g} of this microbatch exceeds {limit:.3g} ({self.factor:g} x the median norm "
                f"of the stage's {len(self.norms)} recent callers, at least {self.floor:g}); nothing accumulated"
            )
        self.accepted += 1
        return norm

    def _record(self, caller: str, norm: float) -> None:
        window = self.norms.pop(caller, None)
        if window is None:
            window = deque(maxlen=self.window)
        window.append(norm)
        self.norms[caller] = window  # the most recent caller last
        while len(self.norms) > MAX_CALLERS:
            self.norms.popitem(last=False)


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Any thread. One device synchronisation for the whole list (NaN propagates through amax/amin; inf is one)."""
    if not tensors:
        return True
    ends = [e for t in tensors if t.numel() for e in torch.aminmax(t.detach())]
    return not ends or bool(torch.isfinite(torch.stack([e.float().to(ends[0].device) for e in ends])).all())
