"""The first losses of the debug model (`swarm-local`'s default) on a fixed text, pinned, so that a change
to the model's math, its initialisation, the data pipeline or the step shows up as a number that moved.

This process mirrors a server's step (server/worker.py `_checked_step`): each stage's gradients clipped to
--clip-grad-norm, then AdamW built by server/optim.py `build_optimizer` with the server's defaults (no warm-up and no
total steps: a constant learning rate), once per global batch. It does not run the server's code path itself; that
the swarm trains what one process does is tests/integration/test_collab.py's.

Tolerance: 1e-4 relative (5e-4 absolute at these losses). Float32 on a CPU sums in an order that may change between
torch builds (the package accepts torch >= 2.3); with the pinned 2.13.0 two runs differed by exactly 0. The tolerance
sits well below the smallest real change measured: an initialisation of another seed moves step 0 by 2.4e-3 (step 1
by 6.3e-2); a learning rate 10% higher moves steps 1..5 by 0.006, 0.029, 0.055, 0.072 and 0.082."""

import pytest
import torch

from server.config import OptimizerConfig
from server.optim import build_optimizer
from swarm.config import model_config
from swarm.model import GPT, clip_gradients
from trainer.data import microbatches

TEXT = (
    "Pipeline stages are served by swarms of interchangeable peers; each trainer wires every microbatch through one "
    "peer per stage, weighted by the throughput it measured, and the peers of a stage average their gradients. "
)
BATCH, MICROBATCHES, STEPS = 4, 4, 6
# the mean loss of each global batch, as computed by torch 2.13.0 on CPU
GOLDEN = [5.562091, 5.107486, 4.652953, 4.316852, 4.054087, 3.806955]
RTOL = 1e-4


def train() -> list[float]:
    torch.manual_seed(0)  # nothing below draws from it; a stray draw would still be reproducible
    cfg = model_config("local_debug")
    model = GPT(cfg)
    opt_cfg = OptimizerConfig()
    optimizers = [
        build_optimizer(opt_cfg.optimizer, list(s.parameters()), opt_cfg.lr, opt_cfg.weight_decay) for s in model.stages
    ]
    corpus = torch.tensor(list((TEXT * 40).encode()), dtype=torch.uint8)
    data = microbatches(corpus, BATCH, cfg.max_seq_len, seed=0)
    losses = []
    for _ in range(STEPS):
        total = 0.0
        for _ in range(MICROBATCHES):
            tokens, labels = next(data)
            loss = model(tokens, labels)
            (loss / MICROBATCHES).backward()
            total += loss.item() / MICROBATCHES
        for stage, optimizer in zip(model.stages, optimizers, strict=True):
            clip_gradients(list(stage.parameters()), opt_cfg.clip_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(total)
    return losses


def test_the_debug_models_first_losses_are_the_pinned_ones():
    losses = train()
    print("losses:", [round(x, 4) for x in losses])
    assert losses == pytest.approx(GOLDEN, rel=RTOL), f"the debug model's losses moved: {losses}"
