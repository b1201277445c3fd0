"""Low-rank stage averaging with error feedback: ACP-SGD (Zhang et al., Algorithms 1-2), one factor per epoch, P at
one epoch and Q at the next, with query reuse; and PowerSGD (Vogels et al., the algorithm ACP-SGD halves), both
factors every epoch in two all-reduces.

Each matrix-shaped gradient M (n x m after flattening the trailing dimensions) is sent as one factor per epoch: at an
even epoch P = (M + E) Q with Q = orth(the Q of the last round), at an odd epoch Q = (M + E)^T P with P = orth(the P
of the last round). The factor is averaged with the stage's all-reduce, which stays additive: the mean of P_i Q^T
over peers is (mean P_i) Q^T, because every peer multiplies by the same Q. The error E = M + E - P_i Q^T (each
peer's own P_i) is fed into the next epoch. Two consecutive rounds make one power iteration, so the factors track
the gradients' dominant subspace; the paper's ablation shows that without error feedback or without reuse ACP trains
poorly, and both can be switched off here to measure that.

Vectors, and matrices whose factors would not be smaller, travel whole. The state every peer of the stage must
share (the last P and Q of each matrix) is part of the stage state a joiner downloads; the error-feedback buffers are
each peer's own residual and are not (a joiner copying them would send its source's residual a second time). A round
that fails commits nothing: the next attempt starts from the same state.

PowerSGD runs a whole power iteration per epoch: P_i = (M_i + E_i) Q with Q = orth(the last Q), all-reduced; P^ =
orth(mean P), the same on every peer because every peer holds the same mean; Q_i = (M_i + E_i)^T P^, all-reduced;
the average is P^ (mean Q)^T and the error E_i = M_i + E_i - P^ Q_i^T. Twice ACP's values and rounds per epoch, in
exchange for an approximation of this epoch's gradient alone rather than of two epochs' running subspace.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

PHASE_FULL, PHASE_P, PHASE_Q = "full", "p", "q"  # a round of whole gradients, of ACP's P factors, of its Q factors
PHASE_PSGD_P, PHASE_PSGD_Q = "psgd-p", "psgd-q"  # PowerSGD's two rounds of one epoch (the tensors kept whole go first)


def orthogonalize(x: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of x's columns (reduced QR in float32)."""
    return torch.linalg.qr(x.float(), mode="reduced").Q


def as_matrix(shape: torch.Size | tuple[int, ...]) -> tuple[int, int] | None:
    """The (rows, columns) a tensor of this shape is compressed as, or None for a vector."""
    if len(shape) < 2:
        return None
    return shape[0], math.prod(shape[1:])


@dataclass(frozen=True)
class Layout:
    """Which tensors of a stage go low-rank and the factors' shapes: a tensor goes low-rank if its rank-r factors
    (P: n x r, Q: m x r) hold fewer values than it does."""

    matrices: tuple[int, ...]  # indices of the low-rank tensors
    dims: tuple[tuple[int, int, int], ...]  # (n, m, r) of each
    whole: tuple[int, ...]  # indices of the tensors that travel whole

    @classmethod
    def of(cls, shapes: list[torch.Size], rank: int) -> Layout:
        if rank < 1:
            raise ValueError(f"the all-reduce rank must be at least 1, got {rank}")
        matrices, dims, whole = [], [], []
        for i, shape in enumerate(shapes):
            nm = as_matrix(shape)
            r = min(rank, *nm) if nm else 0
            if nm and r * (nm[0] + nm[1]) < nm[0] * nm[1]:
                matrices.append(i)
                dims.append((nm[0], nm[1], r))
            else:
                whole.append(i)
        return cls(tuple(matrices), tuple(dims), tuple(whole))

    def factor_shapes(self, phase: str) -> list[tuple[int, int]]:
        return [(n, r) if phase in (PHASE_P, PHASE_PSGD_P) else (m, r) for n, m, r in self.dims]

    def sent_numel(self, phase: str, shapes: list[torch.Size]) -> int:
        """Values one peer hands the all-reduce in a low-rank round of `phase`: the factors, and the whole tensors
        (in every round but PowerSGD's second)."""
        whole = 0 if phase == PHASE_PSGD_Q else sum(math.prod(shapes[i]) for i in self.whole)
        return whole + sum(a * b for a, b in self.factor_shapes(phase))


class LowRankState:
    """One peer's low-rank averaging state for a stage: the shared factors (the same on every peer) and its own error
    feedback. Compute thread or averaging pool, one round at a time."""

    def __init__(self, layout: Layout, seed: int, error_feedback: bool = True, reuse: bool = True):
        self.layout, self.seed, self.error_feedback, self.reuse = layout, seed, error_feedback, reuse
        gen = torch.Generator().manual_seed(seed)  # every peer of the stage starts from the same factors
        self.p = [torch.randn(n, r, generator=gen) for n, _, r in layout.dims]
        self.q = [torch.randn(m, r, generator=gen) for _, m, r in layout.dims]
        self.errors = [torch.zeros(n, m) for n, m, _ in layout.dims]
        self._lock = threading.Lock()

    def _query(self, phase: str, epoch: int) -> list[torch.Tensor]:
        """The orthonormal factor this round multiplies by: the other factor of the last round (reuse), or a fresh
        random one that every peer draws alike from the seed and the epoch (no reuse)."""
        other = PHASE_Q if phase == PHASE_P else PHASE_P
        if self.reuse:
            previous = self.q if other == PHASE_Q else self.p
        else:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            previous = [torch.randn(*shape, generator=gen) for shape in self.layout.factor_shapes(other)]
        return [orthogonalize(x) for x in previous]

    def targets(self, grads: list[torch.Tensor], weight: float) -> list[torch.Tensor]:
        """What each low-rank tensor's factors approximate: its mean gradient over `weight` samples plus, with error
        feedback, the residual per sample (kept as a sum over samples, so that it re-enters the stage's average with
        the mass it left out whatever this peer's share of the next global batch: the samples a peer contributes to
        consecutive epochs differ, 8 then 24 of 32)."""
        out = []
        for k, i in enumerate(self.layout.matrices):
            n, m, _ = self.layout.dims[k]
            target = grads[i].detach().reshape(n, m).float().cpu()
            if self.error_feedback and weight > 0:
                target = target + self.errors[k] / weight
            out.append(target)
        return out

    def shared_tensors(self) -> list[torch.Tensor]:
        """Any thread. What a joiner must copy: the last factors, which every peer of the stage holds alike."""
        with self._lock:
            return [t.clone() for t in (*self.p, *self.q)]

    def check_shared(self, tensors: list[torch.Tensor]) -> None:
        """Raises ValueError unless `tensors` are factors `load_shared` can take."""
        expected = [*self.layout.factor_shapes(PHASE_P), *self.layout.factor_shapes(PHASE_Q)]
        if len(tensors) != len(expected) or any(tuple(t.shape) != s for t, s in zip(tensors, expected, strict=False)):
            raise ValueError("downloaded low-rank factors do not match this stage's (different --allreduce-rank?)")
        if not all(t.is_floating_point() and bool(torch.isfinite(t).all()) for t in tensors):
            raise ValueError("downloaded low-rank factors are not finite floats")

    def load_shared(self, tensors: list[torch.Tensor]) -> None:
        """Inverse of `shared_tensors`. Our residual starts over: it was measured against another history."""
        self.check_shared(tensors)
        k = len(self.layout.dims)
        with self._lock:
            self.p = [t.float().clone() for t in tensors[:k]]
            self.q = [t.float().clone() for t in tensors[k:]]
            self.errors = [torch.zeros(n, m) for n, m, _ in self.layout.dims]

    def checkpoint(self) -> dict[str, list[torch.Tensor]]:
        """Any thread: the factors and this peer's residual, for a checkpoint."""
        with self._lock:
            return {"shared": [t.clone() for t in (*self.p, *self.q)], "errors": [e.clone() for e in self.errors]}

    def restore(self, saved: dict) -> None:
        """Inverse of `checkpoint`; raises ValueError (changing nothing) if it does not fit this layout."""
        errors = saved.get("errors") if isinstance(saved, dict) else None
        shapes = [(n, m) for n, m, _ in self.layout.dims]
        if not isinstance(errors, list) or [tuple(e.shape) for e in errors] != shapes:
            raise ValueError("the checkpoint's error-feedback buffers do not match this stage's")
        if not all(e.is_floating_point() and bool(torch.isfinite(e).all()) for e in errors):
            raise ValueError("the checkpoint's error-feedback buffers are not finite floats")
        self.load_shared(saved.get("shared", []))
        with self._lock:
            self.errors = [e.float().clone() for e in errors]


class AcpState(LowRankState):
    """ACP-SGD: one round per epoch, of P factors at even epochs and of Q factors at odd ones."""

    def compress(self, grads: list[torch.Tensor], epoch: int, weight: float = 1.0) -> Round:
        """This peer's factors for the ACP round of `epoch` (P at even epochs, Q at odd ones), for mean gradients
        over `weight` samples (the peer's weight in the round); changes no state."""
        phase = PHASE_P if epoch % 2 == 0 else PHASE_Q
        queries = self._query(phase, epoch)
        factors, errors = [], []
        for target, query in zip(self.targets(grads, weight), queries, strict=True):
            factor = target @ query if phase == PHASE_P else target.T @ query
            local = factor @ query.T if phase == PHASE_P else query @ factor.T
            factors.append(factor)
            errors.append((target - local) * weight)
        return Round(phase, queries, factors, errors)

    def decompress(self, rnd: Round, averaged: list[torch.Tensor], shapes: list[torch.Size]) -> list[torch.Tensor]:
        """The averaged low-rank gradients, from the round's averaged factors, in the tensors' shapes."""
        out = []
        for k, (factor, query) in enumerate(zip(averaged, rnd.queries, strict=True)):
            approx = factor @ query.T if rnd.phase == PHASE_P else query @ factor.T
            out.append(approx.reshape(shapes[self.layout.matrices[k]]))
        return out

    def commit(self, rnd: Round, averaged: list[torch.Tensor], had_samples: bool) -> None:
        """After a successful round: keep the averaged factor and the query as the next round's factors; keep our
        residual, unless we sent no samples (a zero weight: our factors did not count, so nothing was sent)."""
        p, q = list(self.p), list(self.q)
        for k, (factor, query) in enumerate(zip(averaged, rnd.queries, strict=True)):
            p[k], q[k] = (factor.clone(), query) if rnd.phase == PHASE_P else (query, factor.clone())
        with self._lock:  # a joiner's download reads both lists at once
            self.p, self.q = p, q
            if self.error_feedback and had_samples:
                self.errors = rnd.errors


class PowerSgdState(LowRankState):
    """One peer's PowerSGD state for a stage: the same factors and residual as ACP-SGD's (so joiners and checkpoints
    take it alike), two rounds per epoch: `first`, then `second` with the averaged P, then `finish` with the averaged
    Q; nothing changes before `finish`."""

    def first(self, grads: list[torch.Tensor], epoch: int, weight: float = 1.0) -> PowerRound:
        """The P factors of the epoch's first round: the targets times the last Q (orthonormalized), or a fresh
        random query without reuse."""
        queries = self._query(PHASE_P, epoch)
        targets = self.targets(grads, weight)
        factors = [target @ query for target, query in zip(targets, queries, strict=True)]
        return PowerRound(targets, weight, factors)

    def second(self, rnd: PowerRound, averaged_p: list[torch.Tensor]) -> PowerRound:
        """The Q factors of the epoch's second round, from the first round's average: every peer orthonormalizes the
        same averaged P, so every peer multiplies by the same P^ and the Q round stays additive."""
        p_hat = [orthogonalize(p) for p in averaged_p]
        factors = [target.T @ p for target, p in zip(rnd.targets, p_hat, strict=True)]
        return PowerRound(rnd.targets, rnd.weight, factors, p_hat)

    def finish(
        self, rnd: PowerRound, averaged_q: list[torch.Tensor], shapes: list[torch.Size], had_samples: bool
    ) -> list[torch.Tensor]:
        """After both rounds succeeded: the averaged low-rank gradients P^ (mean Q)^T in the tensors' shapes. P^ and
        the averaged Q are the next epoch's factors (its query is this Q), and our residual is what P^ Q_i^T (our
        own Q_i) missed, as a sum over our samples."""
        assert rnd.p_hat is not None, "finish a PowerSGD epoch after its second round"
        errors = [
            (target - p @ q.T) * rnd.weight
            for target, p, q in zip(rnd.targets, rnd.p_hat, rnd.factors, strict=True)  # fmt: skip
        ]
        with self._lock:
            self.p, self.q = list(rnd.p_hat), [q.clone() for q in averaged_q]
            if self.error_feedback and had_samples:
                self.errors = errors
        return [
            (p @ q.T).reshape(shapes[i])
            for p, q, i in zip(rnd.p_hat, averaged_q, self.layout.matrices, strict=True)  # fmt: skip
        ]


@dataclass
class PowerRound:
    """One PowerSGD epoch in progress: the targets it approximates, this peer's factors for the round at hand (P_i,
    then Q_i), and once the first round is averaged, P^."""

    targets: list[torch.Tensor]
    weight: float
    factors: list[torch.Tensor]
    p_hat: list[torch.Tensor] | None = None


@dataclass
class Round:
    """One round's factors before averaging, and what committing it would keep."""

    phase: str
    queries: list[torch.Tensor]
    factors: list[torch.Tensor]
    errors: list[torch.Tensor]
