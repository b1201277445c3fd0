"""Model configuration and named presets. Every model default lives here, once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class ModelConfig:
    """A GPT-style decoder cut into `n_stages` pipeline stages.

    Each stage holds `layers_per_stage` transformer blocks; with `share_layers` they are one block applied that many
    times (ALBERT-style), otherwise an ordinary stack.
    """

    vocab_size: int = field(
        default=256, metadata={"help": "tokens in the vocabulary (256: bytes, nothing to download)"}
    )
    d_model: int = field(default=128, metadata={"help": "width of the hidden states"})
    n_heads: int = field(default=4, metadata={"help": "attention heads"})
    d_ff: int = field(default=384, metadata={"help": "hidden width of the GeGLU MLP"})
    max_seq_len: int = field(default=128, metadata={"help": "tokens per sequence"})
    n_stages: int = field(default=3, metadata={"help": "pipeline stages the model is cut into"})
    layers_per_stage: int = field(default=2, metadata={"help": "transformer blocks applied per stage"})
    share_layers: bool = field(default=True, metadata={"help": "one block per stage applied --layers-per-stage times"})
    checkpointing: bool = field(default=True, metadata={"help": "recompute activations in backward (saves memory)"})
    seed: int = field(default=0, metadata={"help": "every peer of a stage initialises identically from (seed, stage)"})
    boundary: str = field(
        default="none",
        metadata={
            "help": "compression-aware layers at every stage boundary (SWARM, Appendix I): the sender ends its stage "
            "with LayerNorm, then a linear projection to d_model / --boundary-factor (bottleneck) or the max over "
            "windows of --boundary-factor features (maxout), then LayerNorm; the receiver projects back to d_model. "
            "Hidden states and their gradients between stages shrink by the factor",
            "choices": ["none", "bottleneck", "maxout"],
        },
    )
    boundary_factor: int = field(default=2, metadata={"help": "how much the boundary layers shrink hidden states"})
    tie_embeddings: bool = field(
        default=False,
        metadata={
            "help": "the LM head (last stage) is the token embedding (stage 0): one weight, kept equal on both stages "
            "by one all-reduce of its gradient over the peers of both (--tied-average-every says how often its "
            "copies are also averaged)"
        },
    )

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "d_ff", "max_seq_len", "n_stages", "layers_per_stage"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"--d-model ({self.d_model}) must be divisible by --n-heads ({self.n_heads})")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("head size (--d-model / --n-heads) must be even for rotary embeddings")
        if self.boundary not in ("none", "bottleneck", "maxout"):
            raise ValueError(f"--boundary must be none, bottleneck or maxout, got {self.boundary!r}")
        factor_ok = self.boundary_factor >= 2 and self.d_model % self.boundary_factor == 0
        if self.boundary != "none" and not factor_ok:
            raise ValueError(
                f"--boundary-factor must be >= 2 and divide --d-model ({self.d_model}), got {self.boundary_factor}"
            )

    def shared(self) -> dict:
        """The fields every peer of a swarm must agree on: all but `checkpointing` (a local memory choice)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "checkpointing"}

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def boundary_width(self) -> int:
        """Features of the hidden states that travel between stages."""
        return self.d_model if self.boundary == "none" else self.d_model // self.boundary_factor


def local_debug() -> ModelConfig:
    """Small enough that 3 stages x 2 servers + 2 trainers train visibly on 2 CPU cores."""
    return ModelConfig()


def tiny_test() -> ModelConfig:
    """For unit tests: milliseconds per microbatch."""
    return ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=16, layers_per_stage=2)


def gpt_1b_4stages() -> ModelConfig:
    """Roughly 1B parameters over 4 unshared stages, for GPU servers."""
    return ModelConfig(
        vocab_size=50304,
        d_model=2048,
        n_heads=16,
        d_ff=5504,
        max_seq_len=1024,
        n_stages=4,
        layers_per_stage=5,
        share_layers=False,
    )


PRESETS = {f.__name__: f for f in (local_debug, tiny_test, gpt_1b_4stages)}


def model_config(preset: str = "local_debug", **overrides) -> ModelConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown --preset {preset!r}; choose one of {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[preset](), **overrides)
