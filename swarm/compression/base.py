"""The codec interface: a codec turns a tensor into (header fields, payload bytes) and back; nothing else.

Every codec has a round-trip error-bound test. Integer tensors (token ids, labels) always travel raw.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

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


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


def bytes_to_tensor(
    payload: bytes | bytearray | memoryview, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    if len(payload) == 0:
        return torch.empty(shape, dtype=dtype)
    if isinstance(payload, bytes) or (isinstance(payload, memoryview) and payload.readonly):
        payload = bytearray(payload)  # torch tensors need writable memory
    return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).reshape(shape)


class Codec(ABC):
    wire: int  # wire_pb2.Codec value
    name: str

    @abstractmethod
    def encode(self, t: torch.Tensor) -> tuple[dict, bytes]:
        """-> (extra TensorHeader fields, payload). `t` may live on any device; the payload is host bytes."""

    @abstractmethod
    def decode(self, header: pb.TensorHeader, payload: bytearray, device: torch.device) -> torch.Tensor:
        """Inverse of encode; raises CodecError if the payload size disagrees with the header."""

    @staticmethod
    def _check_size(header: pb.TensorHeader, payload: bytearray, expected: int) -> None:
        if len(payload) != expected:
            raise CodecError(f"tensor {header.name!r}: payload is {len(payload)} bytes, its header implies {expected}")
