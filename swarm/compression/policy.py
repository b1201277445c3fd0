"""Which codec each kind of traffic uses: one policy object, the same on every peer of the swarm.

The trainer encodes activations and activation gradients with it (and asks servers to reply in kind); a server's
stage averaging takes the all-reduce, parameter-averaging and state-download codecs from it. Adding a technique
means adding a codec and naming it here for a role, not branching elsewhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from swarm.compression.base import Codec, TensorRole
from swarm.compression.registry import WHOLE_TENSOR_CODECS, get_codec

# the role of each tensor of a stage call, by its name in the call (int64 tensors are tokens whatever their name)
ROLE_OF_TENSOR = {
    "inputs": TensorRole.ACTIVATIONS,
    "outputs": TensorRole.ACTIVATIONS,
    "grad_outputs": TensorRole.ACTIVATION_GRADIENTS,
    "grad_inputs": TensorRole.ACTIVATION_GRADIENTS,
    "labels": TensorRole.TOKENS,
}


def role_of(name: str, dtype: torch.dtype) -> TensorRole:
    return TensorRole.TOKENS if not dtype.is_floating_point else ROLE_OF_TENSOR[name]


@dataclass(frozen=True, kw_only=True)
class CompressionPolicy:
    """A codec name per role (swarm.compression.registry names them). Tokens always travel exactly. Codecs that carry
    an error to the next tensor (low-rank, token top-k) are for activation gradients only: low-rank forward
    activations diverged in Optimus-CC's experiments, and an error carried between two samples' hidden states changes
    what the next stage computes. Averaging and state downloads go through hivemind, which sends whole tensors."""

    activations: str = "blockwise8"
    activation_gradients: str = "blockwise8"
    allreduce_gradients: str = "blockwise8"
    parameters: str = "none"
    state: str = "none"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            name = getattr(self, f.name)
            try:
                codec = get_codec(name)
            except ValueError as e:
                raise ValueError(f"compression of {f.name}: {e}") from None
            if f.name in ("allreduce_gradients", "parameters", "state") and name not in WHOLE_TENSOR_CODECS:
                raise ValueError(f"compression of {f.name}: {name!r} is not one of {list(WHOLE_TENSOR_CODECS)}")
            if codec.gradients_only and f.name != "activation_gradients":
                raise ValueError(f"compression of {f.name}: {name!r} is for activation gradients only")

    @classmethod
    def for_wire(cls, codec: str, backward_codec: str | None = None) -> CompressionPolicy:
        """`codec` for the pipeline's traffic both ways (the trainer's --codec), or `backward_codec` for the activation
        gradients (--backward-codec); defaults elsewhere."""
        return cls(activations=codec, activation_gradients=backward_codec or codec)

    def codec(self, role: TensorRole) -> Codec:
        return get_codec("none" if role is TensorRole.TOKENS else getattr(self, role.value))

    def describe(self) -> str:
        return ", ".join(f"{f.name} {getattr(self, f.name)}" for f in dataclasses.fields(self))
