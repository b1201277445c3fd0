"""Partition equivalence: the stages run one after another, with the server's stateless forward/backward, give the
same loss and parameter gradients as autograd through the whole model."""

import dataclasses

import pytest
import torch

from swarm.config import ModelConfig, tiny_test
from swarm.model import GPT, Stage, clip_gradients
from swarm.pipeline import stage_backward, stage_forward

# fp32 on CPU; recompute-then-backward runs the same kernels in the same order as one autograd pass, so the only
# differences are reassociation inside the boundary grads: far below 1e-5 relative.
RTOL = 1e-5


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def pipeline_loss_and_grads(stages: list[Stage], tokens, labels) -> float:
    acts = [tokens]
    for stage in stages[:-1]:
        acts.append(stage_forward(stage, acts[-1]))
    result = stage_backward(stages[-1], acts[-1], labels=labels)
    grad = result.grad_inputs
    for stage, inputs in zip(reversed(stages[:-1]), reversed(acts[:-1]), strict=False):
        grad = stage_backward(stage, inputs, grad_outputs=grad).grad_inputs
    assert grad is None  # stage 0 takes token ids
    return result.loss


@pytest.mark.parametrize(
    ("share_layers", "layers_per_stage", "boundary", "factor"),
    [
        (True, 1, "none", 2),
        (True, 3, "none", 2),
        (False, 1, "none", 2),
        (False, 3, "none", 2),
        (True, 2, "bottleneck", 2),
        (True, 2, "bottleneck", 4),
        (False, 2, "maxout", 2),
        (True, 1, "maxout", 4),
    ],
)
def test_partitioned_stages_match_whole_model(share_layers, layers_per_stage, boundary, factor):
    cfg = dataclasses.replace(
        tiny_test(),
        share_layers=share_layers,
        layers_per_stage=layers_per_stage,
        boundary=boundary,
        boundary_factor=factor,
    )
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len), generator=gen)

    whole = GPT(cfg)
    loss_whole = whole(tokens, labels)
    loss_whole.backward()

    stages = [Stage(cfg, i) for i in range(cfg.n_stages)]
    loss_pipe = pipeline_loss_and_grads(stages, tokens, labels)

    assert abs(loss_pipe - loss_whole.item()) / loss_whole.item() < RTOL
    if boundary != "none":  # what travels between stages is the boundary's width, and every boundary layer learns
        assert stages[0](tokens).shape == (4, cfg.max_seq_len, cfg.d_model // factor)
        assert stages[1].boundary_in is not None and stages[1].boundary_in.weight.grad.abs().sum() > 0
        assert stages[0].boundary_out is not None and stages[-1].boundary_out is None
    for stage, ref in zip(stages, whole.stages, strict=False):
        for (name, p), (_, p_ref) in zip(stage.named_parameters(), ref.named_parameters(), strict=False):
            assert torch.equal(p, p_ref), "same (seed, stage) must give the same initial parameters"
            assert relative_error(p.grad, p_ref.grad) < RTOL, name


@pytest.mark.parametrize("n_stages", [1, 2, 3])
def test_tied_embeddings_are_one_weight_whose_gradient_is_the_sum_of_both_stages(n_stages):
    """With --tie-embeddings the LM head is the token embedding. Split into stages, stage 0 and the last stage start
    with equal copies, and the sum of their gradients is the whole model's gradient of the one weight."""
    cfg = dataclasses.replace(tiny_test(), n_stages=n_stages, tie_embeddings=True)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len), generator=gen)

    whole = GPT(cfg)
    assert whole.stages[-1].head.weight is whole.stages[0].embed.weight
    untied = GPT(dataclasses.replace(cfg, tie_embeddings=False))
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in whole.parameters()) == (
        cfg.vocab_size * cfg.d_model
    )
    loss_whole = whole(tokens, labels)
    loss_whole.backward()

    stages = [Stage(cfg, i) for i in range(n_stages)]
    first, last = stages[0], stages[-1]
    if n_stages == 1:  # one stage holds the one weight
        assert first.tied_weight is None and first.head.weight is first.embed.weight
    else:
        assert first.tied_weight is first.embed.weight and last.tied_weight is last.head.weight
        assert torch.equal(first.embed.weight, last.head.weight)
        assert all(s.tied_weight is None for s in stages[1:-1])
    loss_pipe = pipeline_loss_and_grads(stages, tokens, labels)
    assert abs(loss_pipe - loss_whole.item()) / loss_whole.item() < RTOL
    summed = first.embed.weight.grad + (last.head.weight.grad if n_stages > 1 else 0)
    assert relative_error(summed, whole.tied.grad) < RTOL


def test_the_tied_weight_is_clipped_on_its_own():
    """Both stages must scale the tied weight's gradient alike whatever their other gradients are: it is clipped by
    its own norm, the rest by theirs."""
    a, b, tied = (torch.zeros(4, requires_grad=True) for _ in range(3))
    a.grad, b.grad, tied.grad = torch.full((4,), 3.0), torch.full((4,), 4.0), torch.full((4,), 0.25)
    norm = clip_gradients([a, tied, b], 1.0, tied)
    assert norm == pytest.approx((16 * 4 + 9 * 4 + 0.25**2 * 4) ** 0.5)
    assert torch.allclose(torch.cat([a.grad, b.grad]).norm(), torch.tensor(1.0))
    assert torch.equal(tied.grad, torch.full((4,), 0.25))  # already below the limit: untouched
    tied.grad = torch.full((4,), 100.0)
    clip_gradients([a, tied, b], 1.0, tied)
    assert torch.allclose(tied.grad.norm(), torch.tensor(1.0))


def test_grad_weight_accumulates_weighted_sum():
    cfg = tiny_test()
    stage_a, stage_b = Stage(cfg, cfg.n_stages - 1), Stage(cfg, cfg.n_stages - 1)
    h = torch.randn(2, cfg.max_seq_len, cfg.d_model)
    labels = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len))
    stage_backward(stage_a, h, labels=labels, grad_weight=3.0)
    for _ in range(3):
        stage_backward(stage_b, h, labels=labels)
    for pa, pb in zip(stage_a.parameters(), stage_b.parameters(), strict=False):
        assert relative_error(pa.grad, pb.grad) < RTOL


def test_config_errors_name_the_flag():
    with pytest.raises(ValueError, match="--n-heads"):
        ModelConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="--boundary-factor"):
        ModelConfig(d_model=32, n_heads=2, boundary="maxout", boundary_factor=3)
    with pytest.raises(ValueError, match="--boundary "):
        ModelConfig(boundary="pca")
    with pytest.raises(ValueError, match="--stage"):
        Stage(tiny_test(), 7)
