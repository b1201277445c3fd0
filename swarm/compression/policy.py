"""Which codec each kind of traffic uses: one policy object, the same on every peer of the swarm.

The trainer encodes activations and activation gradients with it and asks servers to reply in kind (what a server
accepts to be asked, `requested_reply_codec`, and when it replies so, `epilogue_codec`, are here too); a server's
stage averaging takes the all-reduce, parameter-averaging and state-download codecs from it. Adding a technique
means adding a codec and naming it here for a role, not branching elsewhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from swarm.compression.base import Codec, TensorRole
from swarm.compression.registry import CODECS_BY_WIRE, WHOLE_TENSOR_CODECS, get_codec
from swarm.protocol import wire_pb2 as pb

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


def requested_reply_codec(meta: pb.CallMeta, backward: bool) -> Codec:
    """The codec a caller asks its reply in: by name (`reply_codec_name`, with its settings) or else by wire value
    (`reply_codec`). ValueError for an unknown codec, a gradients-only one (low-rank, top-k) for a Forward's reply
    (activations: as in a policy) or by wire value (its settings travel only in its name), or a `reply_epilogue`
    outside [0, 1]."""
    if meta.reply_codec_name:
        try:
            codec = get_codec(meta.reply_codec_name)
        except ValueError as e:
            raise ValueError(f"reply codec: {e}") from None
        if codec.gradients_only and not backward:
            raise ValueError(f"reply codec {codec.name!r} is for Backward replies only")
        if not 0 <= meta.reply_epilogue <= 1:
            raise ValueError(f"reply_epilogue {meta.reply_epilogue} outside [0, 1]")
        return codec
    if meta.reply_codec not in CODECS_BY_WIRE:
        raise ValueError(f"unknown reply codec {meta.reply_codec}")
    codec = CODECS_BY_WIRE[meta.reply_codec]
    if codec.gradients_only:
        raise ValueError(f"reply codec {meta.reply_codec} must be named (reply_codec_name)")
    return codec


def epilogue_codec(requested: Codec, epilogue: float, batch_done: Callable[[], float]) -> Codec:
    """The codec a Backward's grad_inputs go out in, asked for as `requested` with `epilogue` (CallMeta
    `reply_epilogue`, in [0, 1]); `batch_done()` is the share of its global batch the stage holds, this microbatch
    included, read only where the rule needs it.

    Epilogue-only compression (Optimus-CC; the critical path is the end of each global batch, where the all-reduce
    waits for the last gradients): a gradients-only `requested` with 0 < epilogue < 1 is used only for the
    microbatches that complete the last `epilogue` of the batch (batch_done() > 1 - epilogue); those before travel
    blockwise8, which carries no error into the next. Any other codec, and an epilogue of 0 or 1, is used as asked."""
    if requested.gradients_only and 0 < epilogue < 1 and batch_done() <= 1 - epilogue:
        return CODECS_BY_WIRE[pb.CODEC_BLOCKWISE8]
    return requested
