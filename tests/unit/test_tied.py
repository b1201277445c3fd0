"""Tied embeddings' fused sync (server/collab/tied.py) on real hivemind averagers: one all-reduce over the peers of
stage 0 and of the last stage gives every copy of the tied weight the same step as an all-reduce within each stage
followed by a sync between the two."""

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from server.checkpoint import save_checkpoint
from server.collab.tied import PHASE_TIED, PHASE_TIED_WEIGHTS, TiedAverager, split, unsplit
from server.config import ComputeConfig, OptimizerConfig
from server.export import export_model
from server.worker import StageWorker
from swarm.config import tiny_test
from swarm.model import Stage

pytestmark = pytest.mark.timeout(120)


def state_of(weight: torch.Tensor, m: float = 0.0, v: float = 0.0, step: float = 0.0) -> list[torch.Tensor]:
    """A copy's state as `StageWorker.tied_state` gives it."""
    return [weight, torch.full_like(weight, m), torch.full_like(weight, v), torch.tensor([step])]


def test_split_and_the_round_phases():
    grads = [torch.full((2,), float(i)) for i in range(4)]
    rest, tied = split(grads, 1)
    assert [r[0].item() for r in rest] == [0, 2, 3] and tied is not None and tied[0].item() == 1
    assert [g[0].item() for g in unsplit(rest, 1, tied)] == [0, 1, 2, 3]
    assert split(grads, None) == (grads, None)
    local = [torch.zeros(1), torch.ones(1)]
    round_tensors = TiedAverager.round_tensors
    assert round_tensors(None, [1, PHASE_TIED, "tied-none"], local) == local[:1]
    assert round_tensors(None, [1, PHASE_TIED_WEIGHTS, "tied-none"], local) == local
    for gathered in ([1, "P", "acp"], "garbage", None, [1]):
        with pytest.raises(ValueError, match="tied weight"):
            round_tensors(None, gathered, local)


def test_a_one_stage_tied_model_exports_into_one_process(tmp_path):
    """One stage holds the one weight once: its checkpoint names it as the embedding, and the export gives the head
    the same values."""
    cfg = dataclasses.replace(tiny_test(), n_stages=1, tie_embeddings=True)
    worker = StageWorker(Stage(cfg, 0), OptimizerConfig(), ComputeConfig(), torch.device("cpu"))
    assert worker.tied is None  # one stage: nothing to sync
    path = save_checkpoint(worker, tmp_path / "ckpt")
    assert "head.weight" not in load_file(str(path))
    model = export_model(cfg, [str(tmp_path / "ckpt")], tmp_path / "model.safetensors")
    assert model.tied is model.stages[0].head.weight and torch.equal(model.tied, worker.stage.embed.weight)


def test_the_worker_steps_every_parameter_but_a_tied_weight_without_a_gradient_and_loads_averaged_copies_first():
    """The step after a tied round: a failed round (gradient None) leaves the tied weight and its optimizer state
    untouched while the rest steps; on an averaging epoch the averaged copy is loaded before the step."""
    cfg = dataclasses.replace(tiny_test(), tie_embeddings=True)
    worker = StageWorker(Stage(cfg, 0), OptimizerConfig(), ComputeConfig(), torch.device("cpu"))
    i = worker.tied_index
    assert i is not None and worker.params[i] is worker.tied and len(worker.stage_params) == len(worker.params) - 1
    before = [p.detach().clone() for p in worker.params]
    grads: list = [torch.ones_like(p) for p in worker.params]
    grads[i] = None
    worker.apply_gradients(grads, end_epoch=True)
    assert torch.equal(worker.tied, before[i]) and worker.tied not in worker.optimizer.state
    assert all(not torch.equal(p, b) for j, (p, b) in enumerate(zip(worker.params, before, strict=True)) if j != i)
    weight, m, v, step = worker.tied_state()
    assert torch.equal(weight, before[i]) and not m.any() and not v.any() and step.item() == 0
    average = state_of(torch.full_like(worker.tied, 0.5), m=0.0, v=1e-6, step=1.4)
    grads[i] = torch.zeros_like(worker.tied)
    worker.apply_gradients(grads, end_epoch=True, load={i: average})
    # loaded, then stepped on a zero gradient: AdamW's weight decay alone moved it
    assert torch.allclose(worker.tied, average[0], rtol=1e-3) and worker.epoch == 2
    weight, m, v, step = worker.tied_state()
    assert step.item() == 2  # the averaged count, rounded (1), then this step
    assert torch.allclose(v, torch.full_like(v, 1e-6 * 0.999))  # the loaded second moment, decayed by one step


def test_copies_that_stepped_apart_and_take_the_average_state_step_alike_from_then_on():
    """Two copies, one of which missed a tied step: once both load the average of their states (weight, moments,
    step count), every later step keeps them bitwise equal. With the weights alone they would step apart again."""
    cfg = dataclasses.replace(tiny_test(), tie_embeddings=True)
    a, b = (StageWorker(Stage(cfg, 0), OptimizerConfig(), ComputeConfig(), torch.device("cpu")) for _ in range(2))
    i = a.tied_index
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(p.shape, generator=gen) for p in a.params]
    a.apply_gradients(grads, end_epoch=True)
    b.apply_gradients([None if j == i else g for j, g in enumerate(grads)], end_epoch=True)  # its tied round failed
    assert not torch.equal(a.tied, b.tied)
    average = [(x + y) / 2 for x, y in zip(a.tied_state(), b.tied_state(), strict=True)]
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen) for p in a.params]
        for w in (a, b):  # clones: a step clips its gradients in place
            w.apply_gradients([g.clone() for g in grads], end_epoch=True, load={i: average} if average else None)
        average = None
        assert torch.equal(a.tied, b.tied)


def test_a_loaded_state_with_an_impossible_step_count_or_a_negative_second_moment_is_bounded():
    """An averaged state comes from the round's peers: a step count above our epochs is capped (no copy can have
    stepped more), a negative one clears the optimizer state, a negative second moment is clamped to 0."""
    cfg = dataclasses.replace(tiny_test(), tie_embeddings=True)
    worker = StageWorker(Stage(cfg, 0), OptimizerConfig(), ComputeConfig(), torch.device("cpu"))
    i = worker.tied_index
    w = torch.zeros_like(worker.tied)
    with worker.state_lock, torch.no_grad():
        worker._load_slots(worker.tied, state_of(w, m=0.1, v=-1.0, step=1e30))
    weight, m, v, step = worker.tied_state()
    assert step.item() == worker.epoch + 1 and (v == 0).all() and torch.allclose(m, torch.full_like(m, 0.1))
    with worker.state_lock, torch.no_grad():
        worker._load_slots(worker.tied, state_of(w, step=-5))
    assert worker.tied not in worker.optimizer.state and worker.tied_state()[3].item() == 0
    assert i is not None
