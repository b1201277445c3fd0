"""Local-step training (--local-batch; server/outer.py, StageWorker's inner and outer steps): the math against a
one-process DiLoCo written out by hand, and the state a joiner takes."""

from __future__ import annotations

import pytest
import torch

from server.config import ComputeConfig, EpochConfig, OptimizerConfig
from server.outer import OuterState
from server.state import state_digest
from server.worker import StageWorker
from swarm.config import tiny_test
from swarm.model import Stage
from tests.stages import CPU, random_batch

OUTER_LR, OUTER_MOMENTUM, LOCAL_BATCH, MICROBATCH, MAX_INNER_STEPS = 0.7, 0.9, 4, 2, 4


def _local_worker(cfg, optimizer: OptimizerConfig) -> StageWorker:
    w = StageWorker(Stage(cfg, cfg.n_stages - 1), optimizer, ComputeConfig(), CPU)
    w.enable_local_steps(LOCAL_BATCH, OUTER_LR, OUTER_MOMENTUM, MAX_INNER_STEPS)
    return w


def _microbatches(cfg, worker_index: int, outer_round: int, count: int):
    """The microbatches one simulated worker trains on in one interval: (hidden states, labels), its own data."""
    out = []
    for i in range(count):
        seed = 1000 * outer_round + 100 * worker_index + i
        _, labels = random_batch(cfg, MICROBATCH, seed)
        hidden = torch.randn(MICROBATCH, cfg.max_seq_len, cfg.d_model, generator=torch.Generator().manual_seed(seed))
        out.append((hidden, labels))
    return out


class DiLoCoReference:
    """DiLoCo in one process, written from the paper's algorithm: inner AdamW steps on each worker's mean gradient
    of `LOCAL_BATCH` samples (clipped to the norm the stage clips to), then the sample-weighted mean of the workers'
    pseudo-gradients and one Nesterov step of the outer parameters, which every worker takes as its own."""

    def __init__(self, cfg, optimizer: OptimizerConfig, workers: int):
        self.modules = [Stage(cfg, cfg.n_stages - 1) for _ in range(workers)]
        self.inner = [
            torch.optim.AdamW(m.parameters(), lr=optimizer.lr, weight_decay=optimizer.weight_decay)
            for m in self.modules
        ]
        self.clip = optimizer.clip_grad_norm
        self.outer = [p.detach().clone() for p in self.modules[0].parameters()]
        self.momentum = [torch.zeros_like(p) for p in self.outer]

    def interval(self, data: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        deltas, weights = [], []
        for module, inner, batches in zip(self.modules, self.inner, data, strict=True):
            for start in range(0, len(batches), LOCAL_BATCH // MICROBATCH):
                inner.zero_grad()
                chunk = batches[start : start + LOCAL_BATCH // MICROBATCH]
                for hidden, labels in chunk:
                    (module.loss(hidden, labels) * labels.shape[0] / LOCAL_BATCH).backward()
                torch.nn.utils.clip_grad_norm_(list(module.parameters()), self.clip)
                inner.step()
            deltas.append([o - p.detach() for o, p in zip(self.outer, module.parameters(), strict=True)])
            weights.append(sum(labels.shape[0] for _, labels in batches))
        total = sum(weights)
        with torch.no_grad():
            for i, (o, m) in enumerate(zip(self.outer, self.momentum, strict=True)):
                g = sum(w * d[i] for w, d in zip(weights, deltas, strict=True)) / total
                m.mul_(OUTER_MOMENTUM).add_(g)
                o.sub_(OUTER_LR * (g + OUTER_MOMENTUM * m))
            for module in self.modules:
                for p, o in zip(module.parameters(), self.outer, strict=True):
                    p.copy_(o)


def _average(parts: list[tuple[list[torch.Tensor], int]]) -> list[torch.Tensor]:
    """What the stage's round hands every peer: the sample-weighted mean (here in one process)."""
    total = sum(n for _, n in parts)
    return [sum(n * grads[i] for grads, n in parts) / total for i in range(len(parts[0][0]))]


@pytest.mark.parametrize("intervals,microbatches", [(1, 4), (3, 4), (2, 6)])
def test_inner_and_outer_steps_equal_a_one_process_diloco(intervals, microbatches):
    """Two peers of a stage, each on its own data: after every outer round their parameters are the reference's, and
    bitwise equal to each other (the same average applied to the same outer state)."""
    cfg, optimizer = tiny_test(), OptimizerConfig(lr=1e-2, weight_decay=0.01, clip_grad_norm=1.0)
    workers = [_local_worker(cfg, optimizer) for _ in range(2)]
    reference = DiLoCoReference(cfg, optimizer, 2)
    for r in range(intervals):
        data = [_microbatches(cfg, i, r, microbatches) for i in range(2)]
        for w, batches in zip(workers, data, strict=True):
            for hidden, labels in batches:
                w.backward(hidden, labels=labels, global_batch=w.epoch)
        parts = [w.pseudo_gradients() for w in workers]
        assert [n for _, n in parts] == [MICROBATCH * microbatches] * 2
        averaged = _average(parts)
        for w in workers:
            w.outer_step(averaged)
        reference.interval(data)
        for w in workers:
            assert w.epoch == r + 1 and w.samples_accumulated == 0
            for p, q in zip(w.params, reference.outer, strict=True):
                torch.testing.assert_close(p.detach(), q, rtol=0, atol=1e-6)
        for p, q in zip(workers[0].params, workers[1].params, strict=True):
            assert torch.equal(p, q)
        assert workers[0].digest() == workers[1].digest()  # the outer state: the inner optimizers differ
    assert workers[0].inner_steps == intervals * microbatches * MICROBATCH // LOCAL_BATCH


def test_a_partial_local_batch_steps_as_the_epoch_ends():
    """Samples short of a local batch when the outer round comes are stepped on before the pseudo-gradient."""
    cfg = tiny_test()
    w = _local_worker(cfg, OptimizerConfig())
    hidden, labels = _microbatches(cfg, 0, 0, 1)[0]
    w.backward(hidden, labels=labels, global_batch=0)
    assert w.inner_steps == 0 and w.param_version == 0
    pseudo, n = w.pseudo_gradients()
    assert w.inner_steps == 1 and n == MICROBATCH and any(bool(g.abs().sum() > 0) for g in pseudo)


def _nan_first(honest: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.full_like(honest[0], float("nan")), *honest[1:]]


@pytest.mark.parametrize(
    "spoil",
    [_nan_first, lambda honest: [1e3 * g for g in honest], lambda honest: [-1e3 * g for g in honest]],
    ids=["not finite", "1000x", "-1000x"],
)
def test_an_average_no_inner_steps_make_moves_nothing(spoil):
    """An average that is not finite, or beyond what MAX_INNER_STEPS steps of AdamW can move a parameter (a hostile
    peer's part in the average every peer gets), is refused by each peer alike: the epoch ends, the outer state stays
    and the parameters go back to it. The honest average, a few steps long, is taken."""
    cfg = tiny_test()
    w = _local_worker(cfg, OptimizerConfig())
    outer_before = [p.clone() for p in w.outer.params]
    for hidden, labels in _microbatches(cfg, 0, 0, 4):
        w.backward(hidden, labels=labels, global_batch=0)
    honest, _ = w.pseudo_gradients()
    assert w.inner_steps == 2
    w.outer_step(spoil(honest))
    assert w.steps_skipped == 1 and w.outer.steps == 0 and w.epoch == 1
    for p, o, b in zip(w.params, w.outer.params, outer_before, strict=True):
        assert torch.equal(p.detach(), b) and torch.equal(o, b)
    w.outer_step(honest)
    assert w.steps_skipped == 1 and w.outer.steps == 1


def test_a_joiner_takes_the_outer_state_and_its_digest_is_the_stage_s():
    """A peer that downloads a local-step state starts its inner steps from the outer parameters (not its donor's
    live ones), with the outer momentum; its digest is then the donor's."""
    cfg = tiny_test()
    donor, joiner = _local_worker(cfg, OptimizerConfig()), _local_worker(cfg, OptimizerConfig())
    for r in range(2):
        for hidden, labels in _microbatches(cfg, 0, r, 4):
            donor.backward(hidden, labels=labels, global_batch=donor.epoch)
        donor.outer_step(_average([donor.pseudo_gradients()]))
    for hidden, labels in _microbatches(cfg, 0, 9, 2):  # mid-interval: the donor's live parameters moved on
        donor.backward(hidden, labels=labels, global_batch=donor.epoch)
    assert any(not torch.equal(p, o) for p, o in zip(donor.params, donor.outer.params, strict=True))
    meta, tensors = donor.state_tensors()
    joiner.load_state(meta, tensors)
    assert joiner.epoch == donor.epoch == 2 and joiner.outer.steps == 2
    for p, o in zip(joiner.params, donor.outer.params, strict=True):
        assert torch.equal(p.detach(), o)
    for a, b in zip(joiner.outer.momentum(), donor.outer.momentum(), strict=True):
        assert torch.equal(a, b)
    assert joiner.digest() == donor.digest()
    assert state_digest(tensors, meta) == donor.digest()[1]
    # an inner step leaves the outer state, so the cached digest stands; the next outer step changes it
    cached, generation = joiner.digest(), joiner._generation
    for hidden, labels in _microbatches(cfg, 1, 9, 2):
        joiner.backward(hidden, labels=labels, global_batch=joiner.epoch)
    assert joiner.inner_steps >= 1 and joiner._generation == generation and joiner.digest() == cached
    meta, tensors = joiner.state_tensors()
    assert state_digest(tensors, meta) == cached[1]
    joiner.outer_step(_average([joiner.pseudo_gradients()]))
    assert joiner.digest() != cached


def test_a_state_of_the_other_training_mode_or_a_broken_outer_part_is_refused_changing_nothing():
    cfg = tiny_test()
    local, sync = (
        _local_worker(cfg, OptimizerConfig()),
        StageWorker(Stage(cfg, cfg.n_stages - 1), OptimizerConfig(), ComputeConfig(), CPU),
    )
    local_state, sync_state = local.state_tensors(), sync.state_tensors()
    with pytest.raises(ValueError, match="synchronous training"):
        local.load_state(*sync_state)
    with pytest.raises(ValueError, match="local-step training"):
        sync.load_state(*local_state)
    meta, tensors = local_state
    before = local.digest()
    bad = [
        ({**meta, "outer": {"steps": -1}}, tensors, "outer step count"),
        ({**meta, "outer": {"steps": 1.5}}, tensors, "outer step count"),
        ({**meta, "outer": {"steps": float("inf")}}, tensors, "outer step count"),
        (meta, [*tensors[:-1], torch.full_like(tensors[-1], float("inf"))], "non-finite"),
        (meta, [*tensors[:-1], torch.zeros(3)], "does not match"),
        (meta, tensors[: len(local.params)], "incomplete"),
    ]
    for m, t, why in bad:
        with pytest.raises(ValueError, match=why):
            local.load_state(m, t)
    assert local.digest() == before


def test_outer_state_steps_as_torch_sgd_with_nesterov():
    """OuterState's step is SGD with Nesterov momentum, and skips a non-finite average."""
    params = [torch.randn(3, 4), torch.randn(5)]
    outer = OuterState(params, lr=0.5, momentum=0.8)
    grads = [[torch.randn_like(p) for p in params] for _ in range(3)]
    mine = [p.clone() for p in params]
    momentum = [torch.zeros_like(p) for p in params]
    for g in grads:
        assert outer.step(g)
        for p, m, gi in zip(mine, momentum, g, strict=True):
            m.mul_(0.8).add_(gi)
            p.sub_(0.5 * (gi + 0.8 * m))
    for a, b in zip(outer.params, mine, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert not outer.step([torch.full_like(p, float("inf")) for p in params]) and outer.skipped == 1


@pytest.mark.parametrize(
    "kwargs,why",
    [
        ({"local_batch": -1}, "--local-batch"),
        ({"local_batch": 8, "outer_lr": 0.0}, "--outer-lr"),
        ({"local_batch": 8, "outer_lr": float("nan")}, "--outer-lr"),
        ({"local_batch": 8, "outer_momentum": 1.0}, "--outer-momentum"),
        ({"local_batch": 8, "delay_optimizer_step": True}, "two different training modes"),
    ],
)
def test_local_step_flags_are_checked(kwargs, why):
    with pytest.raises(ValueError, match=why):
        EpochConfig(**kwargs)
