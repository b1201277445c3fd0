"""The codec interface: a codec turns a tensor into (codec parameters, payload bytes) and back; nothing else.

Every codec has a round-trip error-bound test. Integer tensors (token ids, labels) always travel raw.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import StrEnum

import torch

from swarm.compression.memory import ErrorMemory
from swarm.protocol import wire_pb2 as pb

DTYPE_TO_WIRE = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.float16: pb.DTYPE_FLOAT16,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.int64: pb.DTYPE_INT64,
}
WIRE_TO_DTYPE = {v: k for k, v in DTYPE_TO_WIRE.items()}


class CodecError(ValueError):
    """A payload that cannot be what its header says."""


Buffer = bytes | bytearray | memoryview  # what a payload may be (collections.abc.Buffer is Python 3.12+)


def tensor_to_bytes(*tensors: torch.Tensor) -> bytes:
    """The bytes of `tensors`, one after the other, copied once."""
    return b"".join(tensor_view(t) for t in tensors)


def tensor_view(t: torch.Tensor) -> memoryview:
    """The bytes of `t` without a copy where it is a contiguous CPU tensor (a copy otherwise), read-only, so that a
    tensor decoded from them in this process is a copy, not `t` itself. The view keeps the memory alive; `t` must not
    change while the view is in use (a payload on its way: nothing writes to a tensor once it is encoded to send)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().data.toreadonly()


def bytes_to_tensor(payload: Buffer, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if len(payload) == 0:
        return torch.empty(shape, dtype=dtype)
    if isinstance(payload, bytes) or (isinstance(payload, memoryview) and payload.readonly):
        payload = bytearray(payload)  # torch tensors need writable memory
    return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).reshape(shape)


class TensorRole(StrEnum):
    """What a tensor is to the swarm. Each role has its codec in a `CompressionPolicy` and its own byte counters."""

    ACTIVATIONS = "activations"  # Forward inputs and outputs (hidden states)
    ACTIVATION_GRADIENTS = "activation_gradients"  # Backward grad_outputs and grad_inputs
    TOKENS = "tokens"  # token ids and labels: always exact
    ALLREDUCE_GRADIENTS = "allreduce_gradients"  # a stage's gradient all-reduce
    PARAMETERS = "parameters"  # a stage's parameter averaging
    STATE = "state"  # parameters and optimizer state sent to a joining peer


@dataclass(frozen=True)
class CodecContext:
    """Who encodes what. A stateful codec (error feedback, warm-started low-rank factors) keeps its state in the
    sender's `memory`, per stream: the same role, key and shape on the next call continue the same stream, and an
    error is carried only to a tensor of the same global `batch` (see swarm.compression.memory). Without `memory` a
    stateful codec compresses each tensor on its own."""

    role: TensorRole
    key: str = ""
    memory: ErrorMemory | None = None
    batch: int = 0

    def stream(self, shape: tuple[int, ...]) -> tuple[str, str, tuple[int, ...]]:
        return (self.role.value, self.key, shape)

    def with_carried_error(self, shape: tuple[int, ...], g: torch.Tensor) -> torch.Tensor:
        """`g` plus the error the last tensor of this stream left in this batch (taken out of the memory), if any."""
        carried = None if self.memory is None else self.memory.take_error(self.stream(shape), self.batch)
        return g if carried is None else g + carried

    def keep_error(self, shape: tuple[int, ...], error: torch.Tensor) -> None:
        """What this tensor's compression missed, for the next tensor of the stream in this batch."""
        if self.memory is not None:
            self.memory.put_error(self.stream(shape), self.batch, error)

    def warm_start(self, shape: tuple[int, ...]) -> torch.Tensor | None:
        return None if self.memory is None else self.memory.warm_start(self.stream(shape))

    def keep_warm_start(self, shape: tuple[int, ...], q: torch.Tensor) -> None:
        if self.memory is not None:
            self.memory.put_warm_start(self.stream(shape), q)


class Codec(ABC):
    """Turns a tensor into (codec parameters, payload) and back. The parameters travel in the header, opaque to
    everything but the codec, and are validated by it before the payload is read."""

    wire: int  # wire_pb2.Codec value
    name: str
    # compresses a tensor with its error carried to the next (lossy beyond quantization): activation gradients only
    gradients_only = False

    @abstractmethod
    def encode(self, t: torch.Tensor, ctx: CodecContext | None = None) -> tuple[bytes, Buffer]:
        """-> (codec parameters, payload). `t` may live on any device; the payload is host bytes."""

    @abstractmethod
    def decode(
        self, header: pb.TensorHeader, payload: Buffer, device: torch.device, ctx: CodecContext | None = None
    ) -> torch.Tensor:
        """Inverse of encode; raises CodecError if the parameters or the payload size disagree with the header."""

    def value_bound(self, header: pb.TensorHeader, payload: Buffer) -> float | None:
        """An upper bound on the magnitude of every value `decode` returns, read without decoding (after the checks
        `decode` makes of the parameters and the payload's size; raises CodecError like it). None where only
        decoding can tell (NaN and inf included)."""
        return None

    def values_dtype(self, header: pb.TensorHeader, nbytes: int) -> torch.dtype | None:
        """The dtype of the payload's values where the payload of `nbytes` bytes is the values themselves, in order
        (after the checks `decode` makes of the parameters and the size; raises CodecError like it); None for codecs
        that transform them. Such a payload can be checked in the pieces it came in, without joining or decoding."""
        return None

    @abstractmethod
    def encoded_bytes(self, numel: int, dtype: torch.dtype) -> int:
        """Payload bytes of a tensor of `numel` values of `dtype`: for byte accounting without encoding. ValueError
        from codecs whose size depends on the shape (low-rank, top-k)."""

    @staticmethod
    def _check_size(header: pb.TensorHeader, payload: Buffer | int, expected: int) -> None:
        """`payload`: the payload, or its length."""
        n = payload if isinstance(payload, int) else len(payload)
        if n != expected:
            raise CodecError(f"tensor {header.name!r}: payload is {n} bytes, its header implies {expected}")
