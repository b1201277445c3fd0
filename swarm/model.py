"""GPT-style decoder cut into pipeline stages: pre-norm, rotary positions, GeGLU MLP, SDPA attention.

A stage holds one block of parameters applied `layers_per_stage` times (or an unshared stack). Stage 0 adds the token
embedding; the last stage adds the final norm, LM head and loss. `GPT` is the same stages run in one process: its
parameters are bitwise those of the stages a server builds, because every stage initialises from (seed, index).

With `tie_embeddings` the LM head is the token embedding. In `GPT` that is one parameter; in a swarm stage 0 and the
last stage each hold a copy, initialised alike, which stay equal because both step it with the sum of the two
stages' gradients (server/collab/tied.py). Its gradient is clipped on its own (`clip_gradients`), so that both stages
scale it alike whatever their other gradients are.
"""

from __future__ import annotations

import math
import typing

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from swarm.config import ModelConfig

INIT_STD = 0.02  # of every weight but the norms' (residual projections: scaled down by depth)


def init_generator(cfg: ModelConfig, index: int) -> torch.Generator:
    """The generator stage `index` initialises from: the same on every peer of the stage."""
    return torch.Generator().manual_seed(cfg.seed * 1_000_003 + index)


def rotary_tables(seq_len: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles_TH = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # (T, hs/2)
    return angles_TH.cos(), angles_TH.sin()


def apply_rotary(x_BHTS: torch.Tensor, cos_TH: torch.Tensor, sin_TH: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BHTS.float().unflatten(-1, (-1, 2)).unbind(-1)  # pairs of channels rotate together
    rotated = torch.stack((x1 * cos_TH - x2 * sin_TH, x1 * sin_TH + x2 * cos_TH), dim=-1)
    return rotated.flatten(-2).type_as(x_BHTS)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        q, k, v = (
            self.qkv(x_BTD).view(B, T, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        )  # (B, nh, T, hs)
        cos, sin = rotary_tables(T, D // self.n_heads, x_BTD.device)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y_BHTS = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y_BHTS.transpose(1, 2).reshape(B, T, D))


class GeGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        gate, value = self.up(x_BTD).chunk(2, dim=-1)
        return self.down(F.gelu(gate) * value)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm_attn = nn.LayerNorm(cfg.d_model, bias=False)
        self.attn = Attention(cfg)
        self.norm_mlp = nn.LayerNorm(cfg.d_model, bias=False)
        self.mlp = GeGLU(cfg)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.norm_attn(x_BTD))
        return x_BTD + self.mlp(self.norm_mlp(x_BTD))


class BoundaryOut(nn.Module):
    """The sending side of a compression-aware stage boundary (SWARM, Appendix I): LayerNorm, then a linear
    bottleneck or maxout over windows of `boundary_factor` features, then LayerNorm (without the norms training
    diverged in the paper). The receiving stage projects back to d_model (`Stage.boundary_in`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind, self.factor = cfg.boundary, cfg.boundary_factor
        self.norm_in = nn.LayerNorm(cfg.d_model, bias=False)
        self.down = nn.Linear(cfg.d_model, cfg.boundary_width, bias=False) if cfg.boundary == "bottleneck" else None
        self.norm_out = nn.LayerNorm(cfg.boundary_width, bias=False)

    def forward(self, h_BTD: torch.Tensor) -> torch.Tensor:
        h_BTD = self.norm_in(h_BTD)
        if self.down is not None:
            h_BTC = self.down(h_BTD)
        else:
            h_BTC = h_BTD.unflatten(-1, (-1, self.factor)).amax(dim=-1)  # (B, T, D / factor)
        return self.norm_out(h_BTC)


class Stage(nn.Module):
    """Stage `index` of `cfg.n_stages`. Inputs: token ids (B, T) for stage 0, hidden (B, T, C) otherwise.
    Outputs: hidden (B, T, C), or logits (B, T, V) for the last stage. C = `cfg.boundary_width`: d_model, or less with
    compression-aware boundaries."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        if not 0 <= index < cfg.n_stages:
            raise ValueError(f"--stage must be in [0, {cfg.n_stages}), got {index}")
        self.cfg, self.index = cfg, index
        self.is_first, self.is_last = index == 0, index == cfg.n_stages - 1
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model) if self.is_first else None
        n_unique = 1 if cfg.share_layers else cfg.layers_per_stage
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(n_unique))
        self.norm_out = nn.LayerNorm(cfg.d_model, bias=False) if self.is_last else None
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False) if self.is_last else None
        if cfg.tie_embeddings and self.head is not None and self.embed is not None:  # one stage: one weight
            self.head.weight = self.embed.weight
        compressed = cfg.boundary != "none"
        self.boundary_in = nn.Linear(cfg.boundary_width, cfg.d_model, bias=False) if compressed and index else None
        self.boundary_out = BoundaryOut(cfg) if compressed and not self.is_last else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Deterministic in (seed, index) so that every peer of a stage, and `GPT`, start bitwise identical."""
        gen = init_generator(self.cfg, self.index)
        depth_scale = 1 / math.sqrt(2 * self.cfg.n_stages * self.cfg.layers_per_stage)
        for name, p in self.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                std = INIT_STD * (depth_scale if name.endswith(("proj.weight", "down.weight")) else 1.0)
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        if self.tied_weight is not None and self.head is not None:  # the last stage's copy of stage 0's embedding
            self.head.weight.copy_(embedding_init(self.cfg))

    @property
    def tied_weight(self) -> torch.Tensor | None:
        """This stage's copy of the weight that tied embeddings share with another stage (stage 0: the embedding,
        the last stage: the LM head); None when it shares none."""
        if not self.cfg.tie_embeddings or self.cfg.n_stages == 1:
            return None
        if self.embed is not None:
            return self.embed.weight
        return self.head.weight if self.head is not None else None

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            h_BTD = self.embed(inputs)
        else:
            h_BTD = self.boundary_in(inputs) if self.boundary_in is not None else inputs
        for i in range(self.cfg.layers_per_stage):
            block = self.blocks[0 if self.cfg.share_layers else i]
            if self.cfg.checkpointing and torch.is_grad_enabled() and h_BTD.requires_grad:
                h_BTD = checkpoint(block, h_BTD, use_reentrant=False)
            else:
                h_BTD = block(h_BTD)
        if self.head is not None and self.norm_out is not None:  # the last stage
            return self.head(self.norm_out(h_BTD))
        return self.boundary_out(h_BTD) if self.boundary_out is not None else h_BTD

    def loss(self, inputs: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; last stage only."""
        assert self.is_last, "only the last stage computes the loss"
        logits_BTV = self(inputs)
        return F.cross_entropy(logits_BTV.flatten(0, 1).float(), labels_BT.flatten())


def embedding_init(cfg: ModelConfig) -> torch.Tensor:
    """Stage 0's initial token embedding: its first parameter, so the first draw of its generator
    (`Stage.reset_parameters`), without building the rest of stage 0."""
    return torch.randn((cfg.vocab_size, cfg.d_model), generator=init_generator(cfg, 0)) * INIT_STD


def clip_gradients(params: typing.Sequence[torch.Tensor], max_norm: float, tied: torch.Tensor | None = None) -> float:
    """Scale the gradients of `params` to a norm of at most `max_norm`, all but `tied` together and `tied` on its own.
    Returns the norm of all of them (not finite: some gradient is not)."""
    rest = [p for p in params if p is not tied]
    norm = torch.nn.utils.clip_grad_norm_(rest, max_norm) if rest else torch.zeros(())
    if tied is None or tied.grad is None:
        return float(norm)
    tied_norm = torch.nn.utils.clip_grad_norm_([tied], max_norm)
    return float(torch.hypot(norm.float(), tied_norm.float()))


class GPT(nn.Module):
    """All stages in one process: the reference that the partitioned swarm must match. With tied embeddings the last
    stage's head is stage 0's embedding, one parameter (`tied`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.stages = nn.ModuleList(Stage(cfg, i) for i in range(cfg.n_stages))
        last = typing.cast(Stage, self.stages[-1])
        if self.tied is not None and last.head is not None:
            last.head.weight = self.tied

    @property
    def tied(self) -> torch.Tensor | None:
        """The one weight of tied embeddings (stage 0's embedding, also the last stage's head); None without them.
        A property, not an attribute: a module attribute holding a parameter would add a key to the state dict."""
        first = typing.cast(Stage, self.stages[0])
        return first.embed.weight if self.cfg.tie_embeddings and first.embed is not None else None

    def forward(self, tokens_BT: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
        h = tokens_BT
        *body, last = self.stages
        for stage in body:
            h = stage(h)
        return typing.cast(Stage, last).loss(h, labels_BT)
